//! CUDA device access for Custody's CUDA backend: the kernels' sources, the [`Device`] boundary
//! the CUDA forward pass (custody-engine's `cuda_forward`) runs against, and — feature `cuda` —
//! [`CudaDevice`], a real GPU through cudarc. Knows no engine.
//!
//! # Spec
//! - [`open`] answers whether this process can use a CUDA device, as a value: a build without the
//!   `cuda` feature, a machine without the NVIDIA driver (`libcuda.so`), without NVRTC
//!   (`libnvrtc.so.13`), without cuBLASLt (`libcublasLt.so.13`) or without a device is a [`CudaUnavailable`] that names what is missing —
//!   never a panic (`cudarc` panics when its libraries are absent, so they are checked first).
//! - [`KERNEL_SOURCES`] are the kernels of `kernels/cuda`, embedded: the same text the compile
//!   tier (`scripts/nvrtc-check.py`) and the CPU execution tier (the shim) test.
// Every result in runtime/ is handled or dropped with its reason (`Discard`), never `let _ =`.
#![deny(clippy::let_underscore_must_use)]

#[cfg(feature = "cuda")]
mod blas;
pub mod device;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod pinned;
pub mod repack;

pub use device::{
    Arg, Device, DeviceError, DevicePtr, DeviceTags, Download, GemmF16, GraphId, Kernel,
    LaunchDims, Verdict,
};
#[cfg(feature = "cuda")]
pub use driver::CudaDevice;

/// The kernels as one NVRTC translation unit: `custody.cuh`, then each `.cu` without its
/// `#include "custody.cuh"` (NVRTC is given no include path at run time).
pub fn module_source() -> String {
    let mut out = String::new();
    for (name, src) in KERNEL_SOURCES {
        out.push_str(&format!("// ---- {name}\n"));
        for line in src.lines() {
            if line.trim() != "#include \"custody.cuh\"" && line.trim() != "#pragma once" {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// The CUDA sources, by file name (`custody.cuh` is included by the `.cu` files).
pub const KERNEL_SOURCES: [(&str, &str); 4] = [
    (
        "custody.cuh",
        include_str!("../../../kernels/cuda/custody.cuh"),
    ),
    (
        "checksum.cu",
        include_str!("../../../kernels/cuda/checksum.cu"),
    ),
    (
        "attention.cu",
        include_str!("../../../kernels/cuda/attention.cu"),
    ),
    ("ops.cu", include_str!("../../../kernels/cuda/ops.cu")),
];

/// Why CUDA cannot be used here.
#[derive(Debug, thiserror::Error)]
pub enum CudaUnavailable {
    #[error("this build has no CUDA support (rebuild with `--features cuda`)")]
    NotBuilt,
    #[error(
        "the NVIDIA driver library (libcuda.so) is not on this machine: no GPU driver is installed"
    )]
    NoDriver,
    #[error(
        "NVRTC (libnvrtc.so.13, CUDA 13.0) is not found: install the CUDA runtime compiler or add its folder to LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error(
        "cuBLASLt (libcublasLt.so.13, CUDA 13.0) is not found: install the CUDA math libraries (the `nvidia-cublas` wheel or the toolkit) or add their folder to LD_LIBRARY_PATH"
    )]
    NoCublasLt,
    #[error("no usable CUDA device {ordinal}: {why}")]
    NoDevice { ordinal: usize, why: String },
}

/// A CUDA device this process opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
}

/// Open CUDA device `ordinal`, or say why not.
pub fn open(ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
    imp::open(ordinal)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::{CudaUnavailable, DeviceInfo};

    pub fn open(_ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
        Err(CudaUnavailable::NotBuilt)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::{CudaUnavailable, DeviceInfo};

    pub fn open(ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
        // Both checks before any other cudarc call: its loaders panic on a missing library.
        // SAFETY: `is_culib_present` only tries to load the library (dlopen) and reports
        // whether it could; it calls nothing in it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoDriver);
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoNvrtc);
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoCublasLt);
        }
        let ctx =
            cudarc::driver::CudaContext::new(ordinal).map_err(|e| CudaUnavailable::NoDevice {
                ordinal,
                why: e.to_string(),
            })?;
        let name = ctx.name().map_err(|e| CudaUnavailable::NoDevice {
            ordinal,
            why: e.to_string(),
        })?;
        Ok(DeviceInfo { ordinal, name })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On these machines (no GPU, no driver) the answer is a typed error naming what is
    /// missing, in both builds — never a panic.
    #[test]
    fn without_a_gpu_open_says_what_is_missing() {
        if std::path::Path::new("/dev/nvidia0").exists() {
            custody_test_skip::skip(
                "custody_cuda::without_a_gpu_open_says_what_is_missing",
                "this machine has a GPU (the GPU verification runs there)",
                custody_test_skip::Need::Optional,
            );
            return;
        }
        let e = open(0).expect_err("no device here");
        if cfg!(feature = "cuda") {
            assert!(matches!(e, CudaUnavailable::NoDriver), "{e}");
            assert!(e.to_string().contains("libcuda.so"), "{e}");
        } else {
            assert!(matches!(e, CudaUnavailable::NotBuilt), "{e}");
            assert!(e.to_string().contains("--features cuda"), "{e}");
        }
    }

    #[test]
    fn the_module_source_is_one_unit() {
        let m = module_source();
        assert!(!m.contains("#include \"custody.cuh\""));
        assert_eq!(m.matches("struct CustodyVerdict {").count(), 1);
        for k in Kernel::ALL {
            assert!(m.contains(k.name()), "{k:?}");
        }
    }

    #[test]
    fn the_embedded_sources_are_the_kernels() {
        for (name, src) in KERNEL_SOURCES {
            assert!(!src.is_empty(), "{name}");
        }
        assert!(KERNEL_SOURCES[1].1.contains("custody_page_checksum"));
        assert!(KERNEL_SOURCES[2].1.contains("custody_flash_decode"));
    }
}

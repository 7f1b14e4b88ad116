//! Run-time selection of the SIMD level.
//!
//! Detected once; the scalar level is always available and can be forced with
//! `CUSTODY_SIMD=scalar` (used by tests and to measure what SIMD buys).

use std::sync::OnceLock;

/// The instruction-set level the kernels dispatch on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Portable Rust, no target features assumed.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
}

static LEVEL: OnceLock<Level> = OnceLock::new();

static VNNI: OnceLock<bool> = OnceLock::new();

/// Whether AVX-512 VNNI (with VL) is available on top of [`Level::Avx2`].
pub fn has_vnni() -> bool {
    *VNNI.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if level() == Level::Avx2 && std::env::var("CUSTODY_SIMD").map_or(true, |v| v != "avx2")
            {
                return std::is_x86_feature_detected!("avx512vnni")
                    && std::is_x86_feature_detected!("avx512vl");
            }
        }
        false
    })
}

static VNNI512: OnceLock<bool> = OnceLock::new();

/// Whether 512-bit AVX-512 VNNI kernels run here: F, BW, VL and VNNI on top of
/// [`Level::Avx2`] (the repacked mat-vec kernels, `crate::pack`). `CUSTODY_SIMD=avx2` turns
/// them off.
pub fn has_vnni512() -> bool {
    *VNNI512.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if has_vnni() && has_avx512() {
                return std::is_x86_feature_detected!("avx512bw");
            }
        }
        false
    })
}

static AVX512: OnceLock<bool> = OnceLock::new();

/// Whether AVX-512 F (with VL) is available on top of [`Level::Avx2`]: kernels whose arithmetic
/// is fixed lane by lane in portable code (attention) are compiled once more with 512-bit
/// vectors, same operations in the same order, so the same bits. `CUSTODY_SIMD=avx2` turns it
/// off (to measure what it buys).
pub fn has_avx512() -> bool {
    *AVX512.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if level() == Level::Avx2 && std::env::var("CUSTODY_SIMD").map_or(true, |v| v != "avx2")
            {
                return std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512vl");
            }
        }
        false
    })
}

static BF16: OnceLock<bool> = OnceLock::new();

/// Whether AVX-512 BF16 (`vdpbf16ps`) runs here on top of [`has_avx512`]: the BF16 weights'
/// kernel (`crate::bf16`). `CUSTODY_SIMD=avx2` turns it off.
pub fn has_avx512bf16() -> bool {
    *BF16.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                return std::is_x86_feature_detected!("avx512bf16");
            }
        }
        false
    })
}

/// The level in use for this process.
pub fn level() -> Level {
    *LEVEL.get_or_init(detect)
}

fn detect() -> Level {
    if std::env::var("CUSTODY_SIMD").is_ok_and(|v| v == "scalar") {
        return Level::Scalar;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            return Level::Avx2;
        }
    }
    Level::Scalar
}

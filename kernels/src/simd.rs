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

/// This thread's peak rate of 8-bit multiply-accumulates (u8 · i8 summed into i32 lanes) with
/// the widest dot-product instruction the quantized kernels use — 512-bit `vpdpbusd`, where
/// [`has_vnni512`] — measured over ~`duration` of 16 independent accumulation chains: the
/// ceiling of every kernel that multiplies quantized weights by 8-bit activations, so of a
/// prompt's throughput (a benchmark's compute bound). `None` where those kernels do not run.
pub fn int8_dot_peak_macs_per_s(duration: std::time::Duration) -> Option<f64> {
    if !has_vnni512() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        /// Iterations per timed batch: ~10 µs each, so the clock is read rarely.
        const BATCH: u64 = 4096;
        let t0 = std::time::Instant::now();
        let (mut iters, mut sink) = (0u64, 0i32);
        while t0.elapsed() < duration {
            // SAFETY: `has_vnni512` checked AVX-512 F and VNNI above.
            sink = sink.wrapping_add(unsafe { crate::x86_kpack::dpbusd_chains(BATCH) });
            iters += BATCH;
        }
        std::hint::black_box(sink);
        let secs = t0.elapsed().as_secs_f64();
        Some(iters as f64 * crate::x86_kpack::MACS_PER_CHAIN_ITER as f64 / secs)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = duration;
        None
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe measures something where the VNNI kernels run (a figure no 2020s core misses
    /// by 1000×, nor exceeds: 1–10,000 GMAC/s per thread) and nothing elsewhere.
    #[test]
    fn int8_peak_is_measured_exactly_where_the_vnni_kernels_run() {
        let peak = int8_dot_peak_macs_per_s(std::time::Duration::from_millis(20));
        assert_eq!(peak.is_some(), has_vnni512());
        if let Some(p) = peak {
            assert!((1e9..1e13).contains(&p), "{p} MAC/s");
        }
    }
}

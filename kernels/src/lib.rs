//! Compute kernels for Custody.
//!
//! Architecture invariant: this crate knows nothing of requests, tenants, page ownership or I/O.
//! Every kernel is a function over slices. The one place where it sees "ownership" is the
//! paged-attention kernel, which receives opaque tag arrays (generation, owner, filled slots) and
//! an opaque expected owner, and refuses to read any slot whose tag does not match — safety
//! property 1 of the brief ("no stale read") is enforced here, inside the kernel that reads, so no
//! caller can bypass it.
//!
//! Every SIMD kernel has a scalar reference in the same module and a test against it. SIMD paths
//! are chosen at run time ([`simd::level`]); the scalar path is the portable fallback.

pub mod attention;
pub mod bf16;
pub mod checksum;
pub mod kquant;
pub mod matmul;
pub mod ops;
pub mod pack;
pub mod par;
pub mod q8k;
pub mod quant;
pub mod simd;

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_bf16;
#[cfg(target_arch = "x86_64")]
mod x86_kpack;
#[cfg(target_arch = "x86_64")]
mod x86_kquant;
#[cfg(target_arch = "x86_64")]
mod x86_krows;
#[cfg(target_arch = "x86_64")]
mod x86_pack;

pub use attention::{IntegrityError, PageGeometry, PageRef, TagView};
pub use matmul::{QInput, QMatrix};
pub use pack::PackedRows;
pub use quant::{BlockQ8, DType};

#[cfg(test)]
pub(crate) mod test_util {
    /// Deterministic values in [-1, 1) from an LCG state.
    pub(crate) fn rand_f32(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }
}

//! Export the KV transport's probe points from the test binaries too (as the `custody` binary
//! does), so probe tests can attach to them by name. Build the CUDA kernels' host execution
//! tier: `kernels/cuda/*.cu` through the project's CUDA-on-CPU shim (`kernels/cuda/shim`), with
//! their launchers (`tests/cuda/launch.cpp`), for `custody_tests::cuda_shim`.
fn main() {
    println!("cargo::rustc-link-arg-tests=-Wl,--export-dynamic-symbol=custody_kv_*");
    for dir in ["../kernels/cuda", "cuda"] {
        println!("cargo::rerun-if-changed={dir}");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .warnings(true)
        .flag_if_supported("-Wno-unused-parameter")
        // `#pragma unroll` is for NVRTC; the host compiler ignores it.
        .flag_if_supported("-Wno-unknown-pragmas")
        .include("../kernels/cuda")
        .file("../kernels/cuda/shim/cuda_shim.cpp")
        .file("cuda/launch.cpp")
        .compile("custody_cuda_shim");
}

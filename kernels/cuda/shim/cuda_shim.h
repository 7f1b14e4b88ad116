// CUDA-on-CPU: the project's own shim that runs Custody's `.cu` kernels on the host, so their
// logic is tested in CI without a GPU. Each CUDA thread is a user-space fiber (`ucontext`); the
// blocks of a grid run one after another; inside a block the fibers run until each reaches a
// barrier (`__syncthreads`), then all continue — in an order permuted by the launch's seed, so a
// kernel whose result depends on thread order (a race) gives different results under different
// seeds. A barrier that some threads of a block reach while others have exited is reported, as
// is a stack overflow guard hit. `__shared__` is a thread-local static: one block at a time uses it (kernels
// must initialise it, as on a GPU).
//
// Warps: threads 32k..32k+31 of a block (linear id) are warp k. Warp collectives
// (`__shfl_*_sync`, `__syncwarp`) are warp-scoped barriers: each lane deposits its value and
// waits until every live lane of its warp has arrived, so a kernel must reach them convergently
// (full mask only), as on Volta+; a lane that exits or waits at `__syncthreads` while its warp
// waits at a collective is reported.
//
// Counting (the performance model, `custody_shim::Counts`): when a launch is counted, every
// global access a kernel makes through `CUSTODY_LD`/`CUSTODY_ST` (custody.cuh) is recorded with
// its call site, lane and address. The k-th execution of a site by the lanes of one warp is one
// warp-level memory instruction (the grouping a converged warp makes; a divergent branch around
// a load can mis-pair lanes); its 32-byte sectors are counted against the fewest that could
// hold the bytes it asked for. Distinct sectors touched per launch model DRAM traffic (each
// sector once: the L2 absorbs re-reads within a launch — true for the activations, which are
// small; weights and K/V are read once anyway).
//
// What it cannot show (the NVRTC compile tier and the GPU verification cover those): the GPU's
// float contraction and fast-math, the weak memory model and fences, register and shared-memory
// limits, warp-synchronous timing, caches beyond the per-launch sector model.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// CUDA's built-in vector types used by the kernels (16-byte loads).
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(8) float2 {
    float x, y;
};
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}
static inline float4 make_float4(float x, float y, float z, float w) {
    return float4{x, y, z, w};
}

namespace custody_shim {
struct Ids {
    dim3 thread, block, block_dim, grid_dim;
};

// What a counted launch did (see the header comment).
struct Counts {
    uint64_t load_bytes, store_bytes;       // bytes the lanes asked for
    uint64_t load_requests, store_requests; // warp-level memory instructions
    uint64_t sectors;                       // 32-byte sectors those instructions touched
    uint64_t ideal_sectors;                 // the fewest that could hold each one's bytes
    uint64_t dram_sectors;                  // distinct sectors of the whole launch
    uint64_t warp_collectives;              // shuffles and __syncwarp, per warp
};
// Count the launches this OS thread makes from now until `count_end` (which returns the
// totals). Counting is off otherwise: `access` returns at once.
void count_begin();
Counts count_end();
extern thread_local bool counting;
void record(const void* site, const void* addr, unsigned bytes, bool store);
// One lane's value exchanged within its warp: lane `src` of the warp's values.
uint64_t warp_exchange(uint64_t mine, unsigned (*src)(unsigned lane, unsigned arg), unsigned arg);
void syncwarp();
// One lane's part of a warp's MMA: its fragments' registers — the m16n8k16 f16 one's (`c`,
// `d` f32; `mma_m16n8k16`) or the m16n8k32 int8 one's (`ci`, `di` s32; `mma_m16n8k32_s8`).
struct MmaLane {
    unsigned a[4], b[2];
    const float* c;
    float* d;
    const int* ci;
    int* di;
};
// The warp-collective `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` (every lane of the
// warp, converged): d = a·b + c over the warp's fragments, in the PTX ISA's layout (see
// cuda_shim.cpp's `run_mma`). Inline PTX cannot run here; `custody_mma_m16n8k16` (custody.cuh)
// calls this on the shim and the instruction itself on the GPU.
void mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, const float* c);
// `mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32`, the same way: each A and B register four
// signed bytes, C and D s32 (wrapping, as the instruction without .satfinite).
void mma_m16n8k32_s8(int* d, const unsigned* a, const unsigned* b, const int* c);

template <typename T>
inline const T& counted_load(const void* site, const T* p) {
    if (counting) record(site, p, sizeof(T), false);
    return *p;
}
template <typename T, typename V>
inline void counted_store(const void* site, T* p, V v) {
    if (counting) record(site, p, sizeof(T), true);
    *p = (T)v;
}
inline unsigned src_xor(unsigned lane, unsigned m) { return lane ^ m; }
inline unsigned src_down(unsigned lane, unsigned d) { return lane + d < 32 ? lane + d : lane; }
inline unsigned src_idx(unsigned, unsigned i) { return i; }
template <typename T>
inline T shuffle(T v, unsigned (*src)(unsigned, unsigned), unsigned arg) {
    static_assert(sizeof(T) <= 8, "shuffles move up to 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    bits = warp_exchange(bits, src, arg);
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}
// The running fiber's ids (all fibers run on the launching OS thread).
extern thread_local Ids* current;
void syncthreads();
// Run `body(ctx)` as a grid; returns 0, or -1 with a message in `err` (a divergent barrier).
typedef void (*Body)(void* ctx);
int launch(dim3 grid, dim3 block, uint64_t seed, Body body, void* ctx, char* err, size_t err_len);
}  // namespace custody_shim

#define threadIdx (custody_shim::current->thread)
#define blockIdx (custody_shim::current->block)
#define blockDim (custody_shim::current->block_dim)
#define gridDim (custody_shim::current->grid_dim)
#define __global__
#define __device__
#define __forceinline__ inline
// Per OS thread: blocks of launches made from different threads (parallel tests) must not
// share it; within a thread, one block at a time runs.
#define __shared__ static thread_local
#define __syncthreads() custody_shim::syncthreads()
#define __syncwarp(...) custody_shim::syncwarp()
// Full-mask collectives only (the kernels use no partial masks).
#define __shfl_xor_sync(mask, v, m) custody_shim::shuffle((v), custody_shim::src_xor, (m))
#define __shfl_down_sync(mask, v, d) custody_shim::shuffle((v), custody_shim::src_down, (d))
#define __shfl_sync(mask, v, i) custody_shim::shuffle((v), custody_shim::src_idx, (i))
// One call site's identity: a static of its own per expansion.
#define CUSTODY_SHIM_SITE ([]() -> const void* { static const char s = 0; return &s; }())
#define CUSTODY_LD(p) custody_shim::counted_load(CUSTODY_SHIM_SITE, (p))
#define CUSTODY_ST(p, v) custody_shim::counted_store(CUSTODY_SHIM_SITE, (p), (v))

// Blocks run one after another and a block's fibers switch only at barriers: an atomic is a
// plain read-modify-write here, and a fence has nothing to order.
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = old + v;
    return old;
}
#define __threadfence() ((void)0)

// dp4a: the dot product of four signed bytes of a and b, plus c.
static inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}

static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// CUDA-on-CPU: the project's own shim that runs Custody's `.cu` kernels on the host, so their
// logic is tested in CI without a GPU. Each CUDA thread is a user-space fiber (`ucontext`); the
// blocks of a grid run one after another; inside a block the fibers run until each reaches a
// barrier (`__syncthreads`), then all continue — in an order permuted by the launch's seed, so a
// kernel whose result depends on thread order (a race) gives different results under different
// seeds. A barrier that some threads of a block reach while others have exited is reported, as
// is a stack overflow guard hit. `__shared__` is a thread-local static: one block at a time uses it (kernels
// must initialise it, as on a GPU).
//
// What it cannot show (the NVRTC compile tier and the GPU verification cover those): the GPU's
// float contraction and fast-math, the weak memory model and fences, register and shared-memory
// limits, warp-synchronous timing.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace custody_shim {
struct Ids {
    dim3 thread, block, block_dim, grid_dim;
};
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

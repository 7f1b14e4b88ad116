// Shared definitions of Custody's CUDA kernels. The same sources compile two ways:
// - for the GPU with NVRTC (`__CUDACC_RTC__`): the real CUDA built-ins;
// - for the host through the project's CUDA-on-CPU shim (`CUSTODY_CUDA_SHIM`, `shim/cuda_shim.h`):
//   each CUDA thread a fiber, switching at barriers, so the kernels' *logic* runs in CI.
// Kernels must not rely on implicit warp lockstep (the shim does not provide it, and Volta+
// GPUs do not guarantee it either): every exchange between threads goes through a barrier or a
// warp collective (`__shfl_*_sync`, full mask, reached by every lane of the warp).
//
// Global loads and stores of the hot kernels go through `CUSTODY_LD(p)` / `CUSTODY_ST(p, v)`:
// a plain access on the GPU; on the shim, counted (bytes, 32-byte sectors per warp-level
// instruction, distinct sectors per launch) when the launch is counted — the performance model
// of `custody gpu-check model`. A kernel whose accesses are not written this way is counted as
// moving nothing, which the model's tests catch (every modeled kernel must move bytes).
#pragma once

// `CUSTODY_LD_CG(p)`: a load cached in L2 only (`ld.global.cg`), for data other CTAs of the same
// launch wrote (an L1 line of it could be stale).
#ifdef CUSTODY_CUDA_SHIM
#include "shim/cuda_shim.h"
#define CUSTODY_LD_CG(p) CUSTODY_LD(p)
#else
#define CUSTODY_LD(p) (*(p))
#define CUSTODY_ST(p, v) (*(p) = (v))
#define CUSTODY_LD_CG(p) __ldcg(p)
#endif

typedef unsigned int custody_u32;
typedef unsigned long long custody_u64;

// High 64 bits of a 64 × 64-bit product.
__device__ __forceinline__ custody_u64 custody_mul_hi64(custody_u64 a, custody_u64 b) {
#ifdef CUSTODY_CUDA_SHIM
    return (custody_u64)(((unsigned __int128)a * b) >> 64);
#else
    return __umul64hi(a, b);
#endif
}

// IEEE binary16 bits → float, exactly (no cuda_fp16.h needed; same value as __half2float).
__device__ __forceinline__ float custody_half_to_float(unsigned short h) {
    const custody_u32 sign = (custody_u32)(h & 0x8000u) << 16;
    const custody_u32 exp = (h >> 10) & 0x1fu;
    custody_u32 man = h & 0x3ffu;
    custody_u32 bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13); // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign; // ±0
    } else {
        // Subnormal: normalise.
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400u) == 0);
        bits = sign | ((custody_u32)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    return __uint_as_float(bits);
}

// float → IEEE binary16 bits, round to nearest even — bit-identical to `half::f16::from_f32`
// (the CPU's KV cache conversion), NaN payloads included.
__device__ __forceinline__ unsigned short custody_float_to_half(float f) {
    const custody_u32 x = __float_as_uint(f);
    const custody_u32 sign = (x >> 16) & 0x8000u;
    const custody_u32 ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) { // inf / nan (quiet bit set, top payload bits kept)
        const custody_u32 man = ax & 0x7fffffu;
        return (unsigned short)(sign | 0x7c00u | (man != 0 ? 0x200u : 0u) | (man >> 13));
    }
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u); // ≥ 65520 rounds to inf
    if (ax >= 0x38800000u) {                                         // a normal half
        custody_u32 m = ax - 0x38000000u;                           // rebias 127 → 15
        m += 0x0fffu + ((m >> 13) & 1u);
        return (unsigned short)(sign | (m >> 13));
    }
    if (ax < 0x33000000u) return (unsigned short)sign; // ≤ 2^-25 rounds to ±0
    // A subnormal half: the 24-bit significand shifted right by 126 - exponent (14..24).
    const custody_u32 shift = 126u - (ax >> 23);
    const custody_u32 mant = (ax & 0x7fffffu) | 0x800000u;
    custody_u32 r = mant >> shift;
    const custody_u32 rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) r++;
    return (unsigned short)(sign | r);
}

// One block-table entry (layout = `custody_kernels::attention::PageRef`: page, generation).
struct CustodyPageRef {
    custody_u32 page;
    custody_u32 generation;
};

// The tag check's verdict for one request (codes = `custody_kernels::attention::IntegrityError`
// variants in declaration order; 0 = the request may read).
enum CustodyVerdictCode {
    CUSTODY_OK = 0,
    CUSTODY_PAGE_OUT_OF_RANGE = 1,
    CUSTODY_BLOCK_TABLE_TOO_SHORT = 2,
    CUSTODY_STALE_GENERATION = 3,
    CUSTODY_FOREIGN_OWNER = 4,
    CUSTODY_UNWRITTEN_SLOT = 5,
    CUSTODY_IN_BAND_MISMATCH = 7,
};

// code, the failing page, and the values the CPU's error reports (a: expected/have/..., b: found).
struct CustodyVerdict {
    custody_u32 code;
    custody_u32 page;
    custody_u64 a;
    custody_u64 b;
};

// Who reads (layout = `custody_kernels::attention::Reader::words`): the owner value of the
// reader's own pages (its request id) and the tags of the at most CUSTODY_MAX_SHARED namespaces
// whose read-only shared pages (a prefix cache's) it may attend, 0 where unused. A page owned by
// 0 is free: never admitted (no shared slot admits 0, and no request id is 0).
#define CUSTODY_MAX_SHARED 2u
struct CustodyReader {
    custody_u64 owner;
    custody_u64 shared[CUSTODY_MAX_SHARED];
};

// Whether a page whose tag says `page_owner` is one `r` may attend (= `Reader::admits`).
__device__ __forceinline__ bool custody_admits(const CustodyReader& r, custody_u64 page_owner) {
    if (page_owner == r.owner) return true;
    if (page_owner == 0) return false;
    for (custody_u32 i = 0; i < CUSTODY_MAX_SHARED; i++)
        if (page_owner == r.shared[i]) return true;
    return false;
}

// Row `r`'s reader from the launch's array (three loads).
__device__ __forceinline__ CustodyReader custody_load_reader(const CustodyReader* readers,
                                                             custody_u32 r) {
    CustodyReader out;
    out.owner = CUSTODY_LD(&readers[r].owner);
    for (custody_u32 i = 0; i < CUSTODY_MAX_SHARED; i++)
        out.shared[i] = CUSTODY_LD(&readers[r].shared[i]);
    return out;
}

// The pool's page tags (one layer's `filled`), device pointers.
struct CustodyTags {
    const custody_u32* generation;
    const custody_u64* owner;
    const custody_u32* filled;
    const custody_u64* stamp_owner;
    const custody_u32* stamp_generation;
    custody_u32 n_pages;
};

// llama.cpp's RoPE in place: pair i of every head rotated by pos · base^(-2i / n_rot) / f[i],
// for i < n_rot / 2, where f is the frequency factors (Llama 3's rope_freqs; all 1 without
// them — x / 1 is x, bit for bit). The pair is (2i, 2i+1) ("normal": neox = 0) or
// (i, i + n_rot/2) (NeoX: Qwen). Called by every thread of the row's block.
__device__ void custody_rope_row(float* xr, float pos, custody_u32 n_heads, custody_u32 head_dim,
                                 custody_u32 n_rot, float freq_base, const float* freq_factors,
                                 custody_u32 neox) {
    const custody_u32 pairs = n_rot / 2;
    for (custody_u32 k = threadIdx.x; k < n_heads * pairs; k += blockDim.x) {
        const custody_u32 h = k / pairs, i = k % pairs;
        // θ_i = pos · scale^i by repeated products, as the CPU's table builds it (one powf).
        const float theta_scale = powf(freq_base, -2.0f / (float)n_rot);
        float theta = pos;
        for (custody_u32 j = 0; j < i; j++) theta *= theta_scale;
        theta = theta / CUSTODY_LD(freq_factors + i);
        const float c = cosf(theta), s = sinf(theta);
        float* p0 = xr + h * head_dim + (neox ? i : 2 * i);
        float* p1 = p0 + (neox ? pairs : 1);
        const float x0 = CUSTODY_LD(p0), x1 = CUSTODY_LD(p1);
        CUSTODY_ST(p0, fmaf(x0, c, -(x1 * s)));
        CUSTODY_ST(p1, fmaf(x0, s, x1 * c));
    }
}

// One warp's `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` (tensor cores): d = a·b + c,
// a 16 × 16 f16 A (4 f16x2 registers per lane), 16 × 8 f16 B (2), 16 × 8 f32 C and D (4), in
// the PTX ISA's fragment layout. Every lane of the warp calls it, converged. On the shim a
// warp collective computes the same product from the lanes' fragments (shim/cuda_shim.cpp's
// `run_mma`). `d` may be `c`.
__device__ __forceinline__ void custody_mma_m16n8k16(float* d, const custody_u32* a,
                                                     const custody_u32* b, const float* c) {
#ifdef CUSTODY_CUDA_SHIM
    custody_shim::mma_m16n8k16(d, a, b, c);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
#endif
}

// One warp's `mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32` (integer tensor cores): d = a·b
// + c, a 16 × 32 int8 A (4 registers of 4 bytes per lane: a0 A[g][4t..4t+4], a1 A[g + 8][4t..],
// a2 A[g][16 + 4t..], a3 A[g + 8][16 + 4t..] for g = lane / 4, t = lane % 4), a 32 × 8 int8 B
// (b0 B[4t..4t+4][g], b1 B[16 + 4t..][g]), C and D s32 as the f16 MMA's. Every lane of the
// warp calls it, converged; on the shim a warp collective (cuda_shim.cpp's `run_mma_s8`).
__device__ __forceinline__ void custody_mma_m16n8k32_s8(int* d, const custody_u32* a,
                                                        const custody_u32* b, const int* c) {
#ifdef CUSTODY_CUDA_SHIM
    custody_shim::mma_m16n8k32_s8(d, a, b, c);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11, %12, %13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]),
          "r"(c[2]), "r"(c[3]));
#endif
}

// ---- Activations quantized for the dp4a GEMV ("Q8 x").
//
// A row of `cols` activations (a multiple of 256) as int8 in blocks of 32 with a scale each:
// block j (elements 32j..32j+32) has d = max |x| / 127 and q = round(x / d), stored as
// xs[2j] = d, xs[2j + 1] = d · Σq (the Q4_K minimums' term, Σx, without a pass over x). The
// bytes are in the Q4_K GEMV's lane order, so that its lane l reads its 8 values of a
// super-block as one 8-byte load and a warp its 256 as one 256-byte run: element 256b + e
// (e = 64c + 32h + 4p + i; c < 4, h < 2, p < 8, i < 4) is byte 8·(32b + 8c + p) + 4h + i.
// One row's quantized bytes take `cols` bytes and its scales `cols / 16` floats.

// Warp-wide max and sum (every lane gets it).
__device__ __forceinline__ float custody_warp_max(float v) {
    for (custody_u32 m = 16; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

__device__ __forceinline__ int custody_warp_sum_int(int v) {
    for (custody_u32 m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// Quantize one block: lane l holds element k0 + l of row `row` (k0 a multiple of 32; cols a
// multiple of 256) and the warp stores the block's bytes and scales in the layout above. The
// whole warp calls it.
__device__ __forceinline__ void custody_q8_block(float v, custody_u32 row, custody_u32 cols, custody_u32 k0,
                                 unsigned char* xq, float* xs) {
    const custody_u32 lane = threadIdx.x % 32;
    const float amax = custody_warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const int q = amax > 0.0f ? (int)rintf(v * (127.0f / amax)) : 0;
    const int sum = custody_warp_sum_int(q);
    // Four lanes' bytes are one word of the layout: lane 4j gathers lanes 4j+1..4j+3's.
    const custody_u32 b0 = (custody_u32)q & 0xffu;
    const custody_u32 b1 = __shfl_down_sync(0xffffffffu, b0, 1);
    const custody_u32 b2 = __shfl_down_sync(0xffffffffu, b0, 2);
    const custody_u32 b3 = __shfl_down_sync(0xffffffffu, b0, 3);
    const custody_u32 e = k0 % 256 + lane, b = k0 / 256;
    const custody_u32 c = e / 64, h = (e % 64) / 32, p = (e % 32) / 4;
    const custody_u64 sb = (custody_u64)row * (cols / 256) + b;
    if (lane % 4 == 0)
        CUSTODY_ST((custody_u32*)(xq + 8 * (32 * sb + 8 * c + p) + 4 * h),
                   b0 | (b1 << 8) | (b2 << 16) | (b3 << 24));
    if (lane == 0) {
        const custody_u64 j = (custody_u64)row * (cols / 32) + k0 / 32;
        CUSTODY_ST((float2*)(xs + 2 * j), make_float2(d, d * (float)sum));
    }
}


// The forward pass's elementwise and row kernels, the quantized matrix–vector products, and the
// KV page gather/scatter of the transfer path. References: `custody_kernels::ops`,
// `custody_kernels::quant::dequantize_row` (GGUF block layouts) and the transfer's chunk lists.
#include "custody.cuh"

#define CUSTODY_OPS_THREADS 128u

// Sum of `v` over the block (every thread gets it). `red`: CUSTODY_OPS_THREADS floats of shared
// memory. Every thread must call it.
__device__ float custody_block_sum(float v, float* red) {
    const custody_u32 t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (custody_u32 half = CUSTODY_OPS_THREADS / 2; half > 0; half /= 2) {
        if (t < half) red[t] += red[t + half];
        __syncthreads();
    }
    const float s = red[0];
    __syncthreads();
    return s;
}

__device__ float custody_block_max(float v, float* red) {
    const custody_u32 t = threadIdx.x;
    red[t] = v;
    __syncthreads();
    for (custody_u32 half = CUSTODY_OPS_THREADS / 2; half > 0; half /= 2) {
        if (t < half) red[t] = fmaxf(red[t], red[t + half]);
        __syncthreads();
    }
    const float s = red[0];
    __syncthreads();
    return s;
}

// ---- Activations quantized for the dp4a GEMV: `custody_q8_block` (custody.cuh).

// `x` (`gridDim.x` rows of `cols`, a multiple of 256) quantized as above. Grid (rows),
// block (128): warp w quantizes blocks w, w + 4, ….
extern "C" __global__ void custody_quantize_q8(const float* x, custody_u32 cols, unsigned char* xq,
                                              float* xs) {
    const custody_u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* xr = x + (custody_u64)blockIdx.x * cols;
    for (custody_u32 k0 = 32 * warp; k0 < cols; k0 += CUSTODY_OPS_THREADS)
        custody_q8_block(CUSTODY_LD(xr + k0 + lane), blockIdx.x, cols, k0, xq, xs);
}

// RMSNorm of each row: out = x / sqrt(mean(x²) + eps) · w. Grid (rows), block (128). With
// `xq` (and `xs`) not null, `out` is also stored quantized for the dp4a GEMV (`custody_q8_block`;
// dim a multiple of 256): each iteration's warp holds one block of 32.
extern "C" __global__ void custody_rms_norm(const float* x, const float* w, float eps,
                                           custody_u32 dim, float* out, unsigned char* xq,
                                           float* xs) {
    __shared__ float red[CUSTODY_OPS_THREADS];
    const float* xr = x + (custody_u64)blockIdx.x * dim;
    float* o = out + (custody_u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (custody_u32 i = threadIdx.x; i < dim; i += CUSTODY_OPS_THREADS) {
        const float v = CUSTODY_LD(xr + i);
        ss += v * v;
    }
    const float scale = 1.0f / sqrtf(custody_block_sum(ss, red) / (float)dim + eps);
    for (custody_u32 i = threadIdx.x; i < dim; i += CUSTODY_OPS_THREADS) {
        const float v = CUSTODY_LD(xr + i) * scale * CUSTODY_LD(w + i);
        CUSTODY_ST(o + i, v);
        if (xq) custody_q8_block(v, blockIdx.x, dim, i - threadIdx.x % 32, xq, xs);  // uniform
    }
}

// The residual connection and the next RMSNorm in one pass: x += y, then
// out = x / sqrt(mean(x²) + eps) · w — the CPU's residual add and RMSNorm, in the same order
// (each thread re-reads only the elements it wrote). Grid (rows), block (128). `xq`, `xs` as
// custody_rms_norm's.
extern "C" __global__ void custody_add_rms_norm(float* x, const float* y, const float* w, float eps,
                                               custody_u32 dim, float* out, unsigned char* xq,
                                               float* xs) {
    __shared__ float red[CUSTODY_OPS_THREADS];
    float* xr = x + (custody_u64)blockIdx.x * dim;
    const float* yr = y + (custody_u64)blockIdx.x * dim;
    float* o = out + (custody_u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (custody_u32 i = threadIdx.x; i < dim; i += CUSTODY_OPS_THREADS) {
        const float v = CUSTODY_LD(xr + i) + CUSTODY_LD(yr + i);
        CUSTODY_ST(xr + i, v);
        ss += v * v;
    }
    const float scale = 1.0f / sqrtf(custody_block_sum(ss, red) / (float)dim + eps);
    for (custody_u32 i = threadIdx.x; i < dim; i += CUSTODY_OPS_THREADS) {
        const float v = CUSTODY_LD(xr + i) * scale * CUSTODY_LD(w + i);
        CUSTODY_ST(o + i, v);
        if (xq) custody_q8_block(v, blockIdx.x, dim, i - threadIdx.x % 32, xq, xs);  // uniform
    }
}

// llama.cpp's RoPE in place (`custody_rope_row`, custody.cuh) on every row. Grid (rows), block (128).
extern "C" __global__ void custody_rope(float* x, const custody_u32* positions, custody_u32 n_heads,
                                       custody_u32 head_dim, custody_u32 n_rot, float freq_base,
                                       const float* freq_factors, custody_u32 neox) {
    custody_rope_row(x + (custody_u64)blockIdx.x * n_heads * head_dim,
                     (float)CUSTODY_LD(positions + blockIdx.x), n_heads, head_dim, n_rot, freq_base,
                     freq_factors, neox);
}


// x[i] += b[i % width] over `n` elements: a bias added to every row (Qwen 2's Q/K/V biases).
// Grid (ceil(n / 128)), block (128).
extern "C" __global__ void custody_add_rows(float* x, const float* b, custody_u32 width,
                                           custody_u64 n) {
    const custody_u64 i = (custody_u64)blockIdx.x * CUSTODY_OPS_THREADS + threadIdx.x;
    if (i < n) CUSTODY_ST(x + i, CUSTODY_LD(x + i) + CUSTODY_LD(b + i % width));
}

// gate = silu(gate) · up, elementwise over `n`. Grid (ceil(n / 128)), block (128).
extern "C" __global__ void custody_swiglu(float* gate, const float* up, custody_u64 n) {
    const custody_u64 i = (custody_u64)blockIdx.x * CUSTODY_OPS_THREADS + threadIdx.x;
    if (i < n) {
        const float g = CUSTODY_LD(gate + i);
        CUSTODY_ST(gate + i, g / (1.0f + expf(-g)) * CUSTODY_LD(up + i));
    }
}

// Numerically stable softmax of each row in place. Grid (rows), block (128).
extern "C" __global__ void custody_softmax(float* x, custody_u32 n) {
    __shared__ float red[CUSTODY_OPS_THREADS];
    float* r = x + (custody_u64)blockIdx.x * n;
    float m = __uint_as_float(0xff800000u);
    for (custody_u32 i = threadIdx.x; i < n; i += CUSTODY_OPS_THREADS) m = fmaxf(m, r[i]);
    m = custody_block_max(m, red);
    float s = 0.0f;
    for (custody_u32 i = threadIdx.x; i < n; i += CUSTODY_OPS_THREADS) {
        r[i] = expf(r[i] - m);
        s += r[i];
    }
    const float inv = 1.0f / custody_block_sum(s, red);
    for (custody_u32 i = threadIdx.x; i < n; i += CUSTODY_OPS_THREADS) r[i] *= inv;
}

// Weight types (`dtype_code` in runtime/engine/src/cuda_forward.rs).
enum CustodyDType {
    CUSTODY_F32 = 0, CUSTODY_F16 = 1, CUSTODY_Q4_0 = 2, CUSTODY_Q4_1 = 3, CUSTODY_Q8_0 = 4,
    CUSTODY_Q5_0 = 5, CUSTODY_Q5_1 = 6, CUSTODY_Q4_K = 7, CUSTODY_Q5_K = 8, CUSTODY_Q6_K = 9,
    CUSTODY_BF16 = 10, CUSTODY_Q2_K = 11, CUSTODY_Q3_K = 12
};

__device__ __forceinline__ float custody_le_half(const unsigned char* p) {
    return custody_half_to_float((unsigned short)(p[0] | (p[1] << 8)));
}

__device__ __forceinline__ custody_u32 custody_le_u32(const unsigned char* p) {
    return (custody_u32)p[0] | ((custody_u32)p[1] << 8) | ((custody_u32)p[2] << 16) |
           ((custody_u32)p[3] << 24);
}

// Q5_0 / Q5_1 element j of a block whose 4 `qh` bytes start at `qh` and nibbles at `qs`: the
// low nibble of byte j (j < 16) or the high nibble of byte j − 16, with bit j of qh as bit 4.
__device__ __forceinline__ custody_u32 custody_q5(const unsigned char* qh, const unsigned char* qs,
                                                  custody_u32 j) {
    const custody_u32 lo = j < 16 ? (qs[j] & 0xf) : (qs[j - 16] >> 4);
    return lo | (((custody_le_u32(qh) >> j) & 1) << 4);
}

// The j-th 6-bit (scale, min) pair of a Q4_K/Q5_K block (ggml's get_scale_min_k4).
__device__ __forceinline__ void custody_scale_min_k4(custody_u32 j, const unsigned char* q,
                                                     custody_u32* sc, custody_u32* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Element k (< 256) of a Q4_K (hbits = 0) or Q5_K (hbits = the 32 qh bytes) super-block:
// (d·sc)·q − dmin·m, sub-block 2c or 2c+1 the low or high nibbles of bytes 32c..32c+32.
__device__ __forceinline__ float custody_qk45(const unsigned char* b, const unsigned char* hbits,
                                              const unsigned char* qs, custody_u32 k) {
    const custody_u32 c = k / 64, w = k % 64, l = w % 32, sub = 2 * c + (w >= 32);
    custody_u32 sc, m;
    custody_scale_min_k4(sub, b + 4, &sc, &m);
    custody_u32 q = w < 32 ? (qs[32 * c + l] & 0xf) : (qs[32 * c + l] >> 4);
    if (hbits) q += (hbits[l] >> sub) & 1 ? 16 : 0;
    const float d1 = custody_le_half(b) * (float)sc, m1 = custody_le_half(b + 2) * (float)m;
    return d1 * (float)q - m1;
}

// The 2-bit field of element k (< 256) of a Q2_K/Q3_K block's 64 quant bytes: element
// 128n + 32j + 16c + l is bits 2j..2j+2 of qs[32n + 16c + l].
__device__ __forceinline__ custody_u32 custody_q2(const unsigned char* qs, custody_u32 k) {
    const custody_u32 n = k / 128, j = (k / 32) % 4, c = (k / 16) % 2, l = k % 16;
    return (qs[32 * n + 16 * c + l] >> (2 * j)) & 3;
}

// Element k of a Q2_K block (scales[16], qs[64], f16 d, f16 dmin): (d·sc)·q − dmin·m.
__device__ __forceinline__ float custody_q2k(const unsigned char* b, custody_u32 k) {
    const custody_u32 g = b[k / 16];
    const float dl = custody_le_half(b + 80) * (float)(g & 0xf);
    const float ml = custody_le_half(b + 82) * (float)(g >> 4);
    return dl * (float)custody_q2(b + 16, k) - ml;
}

// Element k of a Q3_K block (hmask[32], qs[64], 12 bytes of 6-bit scales, f16 d):
// (d·(sc − 32))·(q2 − 4 where the high bit 4n + j of hmask[16c + l] is clear).
__device__ __forceinline__ float custody_q3k(const unsigned char* b, custody_u32 k) {
    const custody_u32 n = k / 128, j = (k / 32) % 4, c = (k / 16) % 2, l = k % 16, g = k / 16;
    const unsigned char* s = b + 96;
    const custody_u32 lo = g < 8 ? (s[g % 8] & 0xf) : (s[g % 8] >> 4);
    const custody_u32 hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    const int sc = (int)(lo | (hi << 4)) - 32;
    const int high = (b[16 * c + l] >> (4 * n + j)) & 1;
    const int q = (int)custody_q2(b + 32, k) - (high ? 0 : 4);
    return (custody_le_half(b + 108) * (float)sc) * (float)q;
}

// Element k (< 256) of a Q6_K super-block: ql[128], qh[64], 16 i8 scales, f16 d.
__device__ __forceinline__ float custody_q6k(const unsigned char* b, custody_u32 k) {
    const custody_u32 half = k / 128, w = k % 128, quarter = w / 32, l = w % 32;
    const unsigned char* ql = b + 64 * half;
    const unsigned char* qh = b + 128 + 32 * half;
    const signed char* sc = (const signed char*)(b + 192) + 8 * half;
    const custody_u32 byte = ql[l + 32 * (quarter & 1)];
    const custody_u32 lo = quarter < 2 ? (byte & 0xf) : (byte >> 4);
    const custody_u32 hi = (qh[l] >> (2 * quarter)) & 3;
    const int q = (int)(lo | (hi << 4)) - 32;
    return custody_le_half(b + 208) * (float)sc[l / 16 + 2 * quarter] * (float)q;
}

// Element `k` of weight row `row` (GGUF layout, little-endian).
__device__ __forceinline__ float custody_weight(const unsigned char* w, custody_u32 dtype,
                                                custody_u32 cols, custody_u32 row, custody_u32 k) {
    switch (dtype) {
        case CUSTODY_F32: {
            const unsigned char* p = w + ((custody_u64)row * cols + k) * 4;
            return __uint_as_float((custody_u32)p[0] | ((custody_u32)p[1] << 8) |
                                   ((custody_u32)p[2] << 16) | ((custody_u32)p[3] << 24));
        }
        case CUSTODY_F16:
            return custody_le_half(w + ((custody_u64)row * cols + k) * 2);
        case CUSTODY_Q4_0: {
            const unsigned char* b = w + ((custody_u64)row * (cols / 32) + k / 32) * 18;
            const custody_u32 j = k % 32;
            const custody_u32 q = j < 16 ? (b[2 + j] & 0xf) : (b[2 + j - 16] >> 4);
            return ((float)q - 8.0f) * custody_le_half(b);
        }
        case CUSTODY_Q4_1: {
            const unsigned char* b = w + ((custody_u64)row * (cols / 32) + k / 32) * 20;
            const custody_u32 j = k % 32;
            const custody_u32 q = j < 16 ? (b[4 + j] & 0xf) : (b[4 + j - 16] >> 4);
            return (float)q * custody_le_half(b) + custody_le_half(b + 2);
        }
        case CUSTODY_Q5_0: {
            const unsigned char* b = w + ((custody_u64)row * (cols / 32) + k / 32) * 22;
            return ((float)custody_q5(b + 2, b + 6, k % 32) - 16.0f) * custody_le_half(b);
        }
        case CUSTODY_Q5_1: {
            const unsigned char* b = w + ((custody_u64)row * (cols / 32) + k / 32) * 24;
            return (float)custody_q5(b + 4, b + 8, k % 32) * custody_le_half(b) +
                   custody_le_half(b + 2);
        }
        case CUSTODY_Q4_K: {
            const unsigned char* b = w + ((custody_u64)row * (cols / 256) + k / 256) * 144;
            return custody_qk45(b, 0, b + 16, k % 256);
        }
        case CUSTODY_Q5_K: {
            const unsigned char* b = w + ((custody_u64)row * (cols / 256) + k / 256) * 176;
            return custody_qk45(b, b + 16, b + 48, k % 256);
        }
        case CUSTODY_Q6_K:
            return custody_q6k(w + ((custody_u64)row * (cols / 256) + k / 256) * 210, k % 256);
        case CUSTODY_Q2_K:
            return custody_q2k(w + ((custody_u64)row * (cols / 256) + k / 256) * 84, k % 256);
        case CUSTODY_Q3_K:
            return custody_q3k(w + ((custody_u64)row * (cols / 256) + k / 256) * 110, k % 256);
        case CUSTODY_BF16: {
            const unsigned char* p = w + ((custody_u64)row * cols + k) * 2;
            return __uint_as_float(((custody_u32)p[0] | ((custody_u32)p[1] << 8)) << 16);
        }
        default: {  // Q8_0
            const unsigned char* b = w + ((custody_u64)row * (cols / 32) + k / 32) * 34;
            return (float)(signed char)b[2 + k % 32] * custody_le_half(b);
        }
    }
}

// out[r][o] = Σ_k W[o][k] · x[r][k]: W `out_rows × cols` in `dtype` (GGUF bytes), x `n × cols`
// f32. Grid (out_rows, n), block (128): one output per block.
extern "C" __global__ void custody_matvec(const unsigned char* w, custody_u32 dtype,
                                         custody_u32 out_rows, custody_u32 cols, const float* x,
                                         float* out) {
    __shared__ float red[CUSTODY_OPS_THREADS];
    const custody_u32 o = blockIdx.x, r = blockIdx.y;
    const float* xr = x + (custody_u64)r * cols;
    float acc = 0.0f;
    for (custody_u32 k = threadIdx.x; k < cols; k += CUSTODY_OPS_THREADS)
        acc += custody_weight(w, dtype, cols, o, k) * xr[k];
    const float s = custody_block_sum(acc, red);
    if (threadIdx.x == 0) out[(custody_u64)r * out_rows + o] = s;
}

// ---- The GEMM path's conversions (prefill and large batches: the products go to cuBLASLt on
// f16 matrices, `custody_cuda::GemmF16`).
//
// A weight matrix (`rows × cols` in `dtype`, GGUF bytes) dequantized once, at load, to f16
// bits, row-major: out[o][k]. Grid (rows), block (128).
extern "C" __global__ void custody_dequant_f16(const unsigned char* w, custody_u32 dtype,
                                              custody_u32 cols, unsigned short* out) {
    const custody_u32 o = blockIdx.x;
    unsigned short* dst = out + (custody_u64)o * cols;
    for (custody_u32 k = threadIdx.x; k < cols; k += CUSTODY_OPS_THREADS)
        CUSTODY_ST(dst + k, custody_float_to_half(custody_weight(w, dtype, cols, o, k)));
}

// A GEMM's activations: `n` floats rounded to f16 bits (nearest even). Grid (⌈n/128⌉),
// block (128).
extern "C" __global__ void custody_to_f16(const float* x, unsigned short* out, custody_u64 n) {
    const custody_u64 i = (custody_u64)blockIdx.x * CUSTODY_OPS_THREADS + threadIdx.x;
    if (i < n) CUSTODY_ST(out + i, custody_float_to_half(CUSTODY_LD(x + i)));
}

// ---- The decode GEMV on Q4_K weights.
//
// Layout (`custody_cuda::repack::q4k`, made once at upload from the GGUF bytes): a row's
// super-blocks in groups of 4 (the last group padded with zero blocks). For group g of row o
// (`t = o · groups + g`):
// - `heads[4t + s]`: block 4g+s's first 16 bytes as in the file (f16 d, f16 dmin, 12 bytes of
//   packed 6-bit scales and mins);
// - `qs[32t + l]`: 16 bytes, word l (bytes 4l..4l+4) of the 128 quant bytes of blocks 4g..4g+3.
// A warp reads a group's quants as one 512-byte coalesced access (one 16-byte load per lane) and
// its heads as 4 broadcasts; lane l's word holds elements 64c + p .. +4 (low nibbles, sub-block
// 2c) and 64c + 32 + p .. +4 (high nibbles, sub-block 2c+1), c = l / 8, p = 4 (l % 8), so the
// lanes' x loads are 16-byte and contiguous too (lanes 8c..8c+7 read one 128-byte run).
#define CUSTODY_GEMV_WARPS 4u
// x rows per block (grid.y covers the rest): each weight load serves this many rows.
#define CUSTODY_GEMV_BATCH 8u

__device__ __forceinline__ float custody_dot4_nibbles(custody_u32 w, custody_u32 shift, float4 x) {
    return (float)((w >> shift) & 0xfu) * x.x + (float)((w >> (shift + 8)) & 0xfu) * x.y +
           (float)((w >> (shift + 16)) & 0xfu) * x.z + (float)((w >> (shift + 24)) & 0xfu) * x.w;
}

// Byte i (< 12) of the words a, b, c (little-endian), by selection: no local array.
__device__ __forceinline__ custody_u32 custody_byte12(custody_u32 a, custody_u32 b, custody_u32 c,
                                                      custody_u32 i) {
    const custody_u32 w = i < 4 ? a : (i < 8 ? b : c);
    return (w >> (8 * (i % 4))) & 0xffu;
}

// custody_scale_min_k4 on the 12 scale bytes held in three registers.
__device__ __forceinline__ void custody_scale_min_k4_words(custody_u32 j, custody_u32 a,
                                                           custody_u32 b, custody_u32 c,
                                                           custody_u32* sc, custody_u32* m) {
    if (j < 4) {
        *sc = custody_byte12(a, b, c, j) & 63;
        *m = custody_byte12(a, b, c, j + 4) & 63;
    } else {
        const custody_u32 hi = custody_byte12(a, b, c, j + 4);
        *sc = (hi & 0xf) | ((custody_byte12(a, b, c, j - 4) >> 6) << 4);
        *m = (hi >> 4) | ((custody_byte12(a, b, c, j) >> 6) << 4);
    }
}

// A weight row's scale and minimum of sub-blocks 2c (`lo`) and 2c + 1 (`hi`) of the super-block
// whose head is `h`: d·sc and dmin·m.
struct CustodyQ4kScales {
    float d_lo, m_lo, d_hi, m_hi;
};

__device__ __forceinline__ CustodyQ4kScales custody_q4k_scales(uint4 h, custody_u32 c) {
    custody_u32 sc0, m0, sc1, m1;
    custody_scale_min_k4_words(2 * c, h.y, h.z, h.w, &sc0, &m0);
    custody_scale_min_k4_words(2 * c + 1, h.y, h.z, h.w, &sc1, &m1);
    const float d = custody_half_to_float((unsigned short)(h.x & 0xffffu));
    const float dmin = custody_half_to_float((unsigned short)(h.x >> 16));
    CustodyQ4kScales s;
    s.d_lo = d * (float)sc0;
    s.m_lo = dmin * (float)m0;
    s.d_hi = d * (float)sc1;
    s.m_hi = dmin * (float)m1;
    return s;
}

__device__ __forceinline__ float custody_sum4(float4 x) { return (x.x + x.y) + (x.z + x.w); }

// out[r][o] = Σ_k W[o][k] · x[r][k] for W Q4_K in the layout above, x `n × cols` f32 (cols a
// multiple of 256), out `n × rows`. Grid (ceil(rows / 4), ceil(n / 8)), block (128): warp w of
// block b computes row 4b + w for x rows 8·blockIdx.y .. +8.
// Row `row` of a Q4_K matrix in tiles times x rows r0..r0+nr: lane partials in acc (the warp's
// sum is the product). The whole warp calls it.
__device__ __forceinline__ void custody_gemv_q4k_row(const uint4* heads, const uint4* qs,
                                                     custody_u32 row, custody_u32 cols,
                                                     const float* x, custody_u32 r0,
                                                     custody_u32 nr, float* acc) {
    const custody_u32 lane = threadIdx.x % 32;
    const custody_u32 nb = cols / 256, groups = (nb + 3) / 4;
    const custody_u32 c = lane / 8, p = 4 * (lane % 8);
#pragma unroll
    for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) acc[r] = 0.0f;
    for (custody_u32 g = 0; g < groups; g++) {
        const custody_u64 t = (custody_u64)row * groups + g;
        const uint4 w4 = CUSTODY_LD(qs + 32 * t + lane);
        const custody_u32 words[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
        for (custody_u32 s = 0; s < 4; s++) {
            const custody_u32 b = 4 * g + s;
            if (b >= nb) break;  // the same for every lane
            const CustodyQ4kScales sc = custody_q4k_scales(CUSTODY_LD(heads + 4 * t + s), c);
            const float d0 = sc.d_lo, m0f = sc.m_lo, d1 = sc.d_hi, m1f = sc.m_hi;
            const custody_u32 k = 256 * b + 64 * c + p;
#pragma unroll
            for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) {
                if (r >= nr) break;
                const float* xr = x + (custody_u64)(r0 + r) * cols + k;
                const float4 lo = CUSTODY_LD((const float4*)xr);
                const float4 hi = CUSTODY_LD((const float4*)(xr + 32));
                acc[r] += d0 * custody_dot4_nibbles(words[s], 0, lo) - m0f * custody_sum4(lo) +
                          d1 * custody_dot4_nibbles(words[s], 4, hi) - m1f * custody_sum4(hi);
            }
        }
    }
}

__device__ __forceinline__ float custody_warp_sum(float v) {
    for (custody_u32 m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// A GEMV's outputs: each x row's warp sum, stored by lane 0 at out[r0 + r][row] (`rows` wide).
__device__ __forceinline__ void custody_gemv_store(const float* acc, float* out, custody_u32 rows,
                                                   custody_u32 row, custody_u32 r0,
                                                   custody_u32 nr) {
#pragma unroll
    for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) {
        const float v = custody_warp_sum(acc[r]);
        if (threadIdx.x % 32 == 0 && r < nr) CUSTODY_ST(out + (custody_u64)(r0 + r) * rows + row, v);
    }
}

extern "C" __global__ void custody_gemv_q4k(const uint4* heads, const uint4* qs, custody_u32 rows,
                                           custody_u32 cols, const float* x, custody_u32 n,
                                           float* out) {
    const custody_u32 warp = threadIdx.x / 32;
    const custody_u32 row = blockIdx.x * CUSTODY_GEMV_WARPS + warp;
    const custody_u32 r0 = blockIdx.y * CUSTODY_GEMV_BATCH;
    if (row >= rows) return;  // the whole warp: no collective below is left half-reached
    const custody_u32 nr = n - r0 < CUSTODY_GEMV_BATCH ? n - r0 : CUSTODY_GEMV_BATCH;
    float acc[CUSTODY_GEMV_BATCH];
    custody_gemv_q4k_row(heads, qs, row, cols, x, r0, nr, acc);
    custody_gemv_store(acc, out, rows, row, r0, nr);
}

// The attention's Q, K and V products in one launch, all three Q4_K in tiles: warp rows
// 0..q_rows are Q's, then kv_rows of K's, then kv_rows of V's, each written to its own output
// (`custody_gemv_q4k` three times, the same arithmetic). Grid (ceil((q_rows + 2 kv_rows) / 4),
// ceil(n / 8)), block (128).
extern "C" __global__ void custody_gemv_q4k_qkv(const uint4* q_heads, const uint4* q_qs,
                                               custody_u32 q_rows, const uint4* k_heads,
                                               const uint4* k_qs, const uint4* v_heads,
                                               const uint4* v_qs, custody_u32 kv_rows,
                                               custody_u32 cols, const float* x, custody_u32 n,
                                               float* q_out, float* k_out, float* v_out) {
    const custody_u32 warp = threadIdx.x / 32;
    custody_u32 row = blockIdx.x * CUSTODY_GEMV_WARPS + warp;
    const custody_u32 r0 = blockIdx.y * CUSTODY_GEMV_BATCH;
    if (row >= q_rows + 2 * kv_rows) return;  // the whole warp: no collective is half-reached
    const custody_u32 nr = n - r0 < CUSTODY_GEMV_BATCH ? n - r0 : CUSTODY_GEMV_BATCH;
    float acc[CUSTODY_GEMV_BATCH];
    float* out;
    custody_u32 rows;
    // One call per matrix (uniform per warp): selecting the pointers instead costs registers.
    if (row < q_rows) {
        custody_gemv_q4k_row(q_heads, q_qs, row, cols, x, r0, nr, acc);
        out = q_out, rows = q_rows;
    } else if (row < q_rows + kv_rows) {
        row -= q_rows;
        custody_gemv_q4k_row(k_heads, k_qs, row, cols, x, r0, nr, acc);
        out = k_out, rows = kv_rows;
    } else {
        row -= q_rows + kv_rows;
        custody_gemv_q4k_row(v_heads, v_qs, row, cols, x, r0, nr, acc);
        out = v_out, rows = kv_rows;
    }
    custody_gemv_store(acc, out, rows, row, r0, nr);
}

// The FFN's gate and up products and the SwiGLU in one launch, both matrices Q4_K in tiles:
// out[r][o] = silu(gate_o · x_r) · (up_o · x_r) — `custody_gemv_q4k` twice and `custody_swiglu`,
// the same arithmetic, without the two products' rows going to memory and back. Grid and block
// as custody_gemv_q4k.
extern "C" __global__ void custody_gemv_q4k_swiglu(const uint4* gate_heads, const uint4* gate_qs,
                                                  const uint4* up_heads, const uint4* up_qs,
                                                  custody_u32 rows, custody_u32 cols,
                                                  const float* x, custody_u32 n, float* out) {
    const custody_u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const custody_u32 row = blockIdx.x * CUSTODY_GEMV_WARPS + warp;
    const custody_u32 r0 = blockIdx.y * CUSTODY_GEMV_BATCH;
    if (row >= rows) return;  // the whole warp: no collective below is left half-reached
    const custody_u32 nr = n - r0 < CUSTODY_GEMV_BATCH ? n - r0 : CUSTODY_GEMV_BATCH;
    float acc_g[CUSTODY_GEMV_BATCH], acc_u[CUSTODY_GEMV_BATCH];
    custody_gemv_q4k_row(gate_heads, gate_qs, row, cols, x, r0, nr, acc_g);
    custody_gemv_q4k_row(up_heads, up_qs, row, cols, x, r0, nr, acc_u);
#pragma unroll
    for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) {
        const float g = custody_warp_sum(acc_g[r]), u = custody_warp_sum(acc_u[r]);
        if (lane == 0 && r < nr)
            CUSTODY_ST(out + (custody_u64)(r0 + r) * rows + row, g / (1.0f + expf(-g)) * u);
    }
}

// ---- The decode GEMV on Q4_K weights and Q8 x, with dp4a.
//
// The same tiles and lane mapping as custody_gemv_q4k; x quantized by its producer
// (`custody_q8_block`). Per super-block and x row a lane makes two dp4a — its 4 low nibbles
// (sub-block 2c) and 4 high ones (2c + 1) against their int8 x — instead of 16 FP32 FMAs, and
// adds its eighth of the minimums' term (dmin · m · d_x · Σq_x, the block's sum, shared by the
// 8 lanes of a sub-block: an exact eighth). x per lane and super-block: one 8-byte load (the
// warp's: 256 contiguous bytes) and one 16-byte broadcast of the two blocks' scales.
__device__ __forceinline__ void custody_gemv_q4k_q8_row(const uint4* heads, const uint4* qs,
                                                        custody_u32 row, custody_u32 cols,
                                                        const uint2* xq, const float4* xs,
                                                        custody_u32 r0, custody_u32 nr,
                                                        float* acc) {
    const custody_u32 lane = threadIdx.x % 32;
    const custody_u32 nb = cols / 256, groups = (nb + 3) / 4;
    const custody_u32 c = lane / 8;
#pragma unroll
    for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) acc[r] = 0.0f;
    for (custody_u32 g = 0; g < groups; g++) {
        const custody_u64 t = (custody_u64)row * groups + g;
        const uint4 w4 = CUSTODY_LD(qs + 32 * t + lane);
        const custody_u32 words[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
        for (custody_u32 s = 0; s < 4; s++) {
            const custody_u32 b = 4 * g + s;
            if (b >= nb) break;  // the same for every lane
            const CustodyQ4kScales sc = custody_q4k_scales(CUSTODY_LD(heads + 4 * t + s), c);
            // A lane's eighth of the minimums' term (8 lanes share a sub-block: exact).
            const float d0 = sc.d_lo, m0f = 0.125f * sc.m_lo, d1 = sc.d_hi, m1f = 0.125f * sc.m_hi;
            const int lo = (int)(words[s] & 0x0f0f0f0fu), hi = (int)((words[s] >> 4) & 0x0f0f0f0fu);
#pragma unroll
            for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) {
                if (r >= nr) break;
                const custody_u64 sb = (custody_u64)(r0 + r) * nb + b;
                const uint2 xv = CUSTODY_LD(xq + 32 * sb + lane);
                const float4 sx = CUSTODY_LD(xs + 4 * sb + c);
                acc[r] += d0 * sx.x * (float)__dp4a(lo, (int)xv.x, 0) - m0f * sx.y +
                          d1 * sx.z * (float)__dp4a(hi, (int)xv.y, 0) - m1f * sx.w;
            }
        }
    }
}

// custody_gemv_q4k on Q8 x (`xq`, `xs`: n rows of `cols` in custody_q8_block's layout). Grid
// and block as custody_gemv_q4k.
extern "C" __global__ void custody_gemv_q4k_q8(const uint4* heads, const uint4* qs,
                                              custody_u32 rows, custody_u32 cols,
                                              const uint2* xq, const float4* xs, custody_u32 n,
                                              float* out) {
    const custody_u32 warp = threadIdx.x / 32;
    const custody_u32 row = blockIdx.x * CUSTODY_GEMV_WARPS + warp;
    const custody_u32 r0 = blockIdx.y * CUSTODY_GEMV_BATCH;
    if (row >= rows) return;  // the whole warp: no collective below is left half-reached
    const custody_u32 nr = n - r0 < CUSTODY_GEMV_BATCH ? n - r0 : CUSTODY_GEMV_BATCH;
    float acc[CUSTODY_GEMV_BATCH];
    custody_gemv_q4k_q8_row(heads, qs, row, cols, xq, xs, r0, nr, acc);
    custody_gemv_store(acc, out, rows, row, r0, nr);
}

// custody_gemv_q4k_qkv on Q8 x. Grid and block as custody_gemv_q4k_qkv.
extern "C" __global__ void custody_gemv_q4k_q8_qkv(const uint4* q_heads, const uint4* q_qs,
                                                  custody_u32 q_rows, const uint4* k_heads,
                                                  const uint4* k_qs, const uint4* v_heads,
                                                  const uint4* v_qs, custody_u32 kv_rows,
                                                  custody_u32 cols, const uint2* xq,
                                                  const float4* xs, custody_u32 n, float* q_out,
                                                  float* k_out, float* v_out) {
    const custody_u32 warp = threadIdx.x / 32;
    custody_u32 row = blockIdx.x * CUSTODY_GEMV_WARPS + warp;
    const custody_u32 r0 = blockIdx.y * CUSTODY_GEMV_BATCH;
    if (row >= q_rows + 2 * kv_rows) return;  // the whole warp: no collective is half-reached
    const custody_u32 nr = n - r0 < CUSTODY_GEMV_BATCH ? n - r0 : CUSTODY_GEMV_BATCH;
    float acc[CUSTODY_GEMV_BATCH];
    float* out;
    custody_u32 rows;
    if (row < q_rows) {
        custody_gemv_q4k_q8_row(q_heads, q_qs, row, cols, xq, xs, r0, nr, acc);
        out = q_out, rows = q_rows;
    } else if (row < q_rows + kv_rows) {
        row -= q_rows;
        custody_gemv_q4k_q8_row(k_heads, k_qs, row, cols, xq, xs, r0, nr, acc);
        out = k_out, rows = kv_rows;
    } else {
        row -= q_rows + kv_rows;
        custody_gemv_q4k_q8_row(v_heads, v_qs, row, cols, xq, xs, r0, nr, acc);
        out = v_out, rows = kv_rows;
    }
    custody_gemv_store(acc, out, rows, row, r0, nr);
}

// custody_gemv_q4k_swiglu on Q8 x. Grid and block as custody_gemv_q4k.
extern "C" __global__ void custody_gemv_q4k_q8_swiglu(const uint4* gate_heads,
                                                     const uint4* gate_qs, const uint4* up_heads,
                                                     const uint4* up_qs, custody_u32 rows,
                                                     custody_u32 cols, const uint2* xq,
                                                     const float4* xs, custody_u32 n, float* out) {
    const custody_u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const custody_u32 row = blockIdx.x * CUSTODY_GEMV_WARPS + warp;
    const custody_u32 r0 = blockIdx.y * CUSTODY_GEMV_BATCH;
    if (row >= rows) return;  // the whole warp: no collective below is left half-reached
    const custody_u32 nr = n - r0 < CUSTODY_GEMV_BATCH ? n - r0 : CUSTODY_GEMV_BATCH;
    float acc[CUSTODY_GEMV_BATCH];
    custody_gemv_q4k_q8_row(gate_heads, gate_qs, row, cols, xq, xs, r0, nr, acc);
    // x row r's gate product is kept by lane r alone while the up products are made (one
    // register, not CUSTODY_GEMV_BATCH: the kernel stays within 64).
    float gate = 0.0f;
#pragma unroll
    for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) {
        const float g = custody_warp_sum(acc[r]);
        if (lane == r) gate = g;
    }
    custody_gemv_q4k_q8_row(up_heads, up_qs, row, cols, xq, xs, r0, nr, acc);
#pragma unroll
    for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) {
        const float u = custody_warp_sum(acc[r]);
        const float g = __shfl_sync(0xffffffffu, gate, r);
        if (lane == 0 && r < nr)
            CUSTODY_ST(out + (custody_u64)(r0 + r) * rows + row, g / (1.0f + expf(-g)) * u);
    }
}

// Q6_K in `custody_cuda::repack::q6k`'s tiles (groups of 8 super-blocks; lane l owns elements
// 4l..4l+3 and 128+4l..128+4l+3 of every block): per group, heads[9t] the 8 blocks' f16 d,
// heads[9t + 1 + s] block s's 16 int8 scales; qs[(3t + j)·32 + l] lane l's 16 bytes of chunk j —
// its low nibbles of blocks 0–3 (j = 0) and 4–7 (j = 1) as words, its high pairs of blocks 0–7
// as half-words (j = 2). Three 512-byte coalesced warp loads per group; the heads are
// broadcasts; each of a lane's two x loads is a warp's contiguous 512 bytes. Each half of a
// lane's values shares one scale: index 2·(l / 8) + (l % 8) / 4, and 8 more for the second
// (ggml's order). Grid and block as custody_gemv_q4k.
// Σ (q_i − 32) · x_i over values i0..i0+3 of a lane's 8 (low nibbles `lo`, high pairs `hi`).
__device__ __forceinline__ float custody_dot4_q6(custody_u32 lo, custody_u32 hi, custody_u32 i0,
                                                 float4 a) {
#define CUSTODY_Q6(i) ((float)(((lo >> (4 * (i))) & 0xfu) | (((hi >> (2 * (i))) & 3u) << 4)) - 32.0f)
    return (CUSTODY_Q6(i0) * a.x + CUSTODY_Q6(i0 + 1) * a.y) +
           (CUSTODY_Q6(i0 + 2) * a.z + CUSTODY_Q6(i0 + 3) * a.w);
#undef CUSTODY_Q6
}

__device__ __forceinline__ custody_u32 custody_word_of(uint4 v, custody_u32 i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

extern "C" __global__ void custody_gemv_q6k(const uint4* heads, const uint4* qs, custody_u32 rows,
                                           custody_u32 cols, const float* x, custody_u32 n,
                                           float* out) {
    const custody_u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const custody_u32 row = blockIdx.x * CUSTODY_GEMV_WARPS + warp;
    const custody_u32 r0 = blockIdx.y * CUSTODY_GEMV_BATCH;
    if (row >= rows) return;  // the whole warp: no collective below is left half-reached
    const custody_u32 nr = n - r0 < CUSTODY_GEMV_BATCH ? n - r0 : CUSTODY_GEMV_BATCH;
    const custody_u32 nb = cols / 256, groups = (nb + 7) / 8;
    const custody_u32 sidx = 2 * (lane / 8) + (lane % 8) / 4;
    float acc[CUSTODY_GEMV_BATCH];
#pragma unroll
    for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) acc[r] = 0.0f;
    for (custody_u32 g = 0; g < groups; g++) {
        const custody_u64 t = (custody_u64)row * groups + g;
        const uint4 lo_a = CUSTODY_LD(qs + (3 * t + 0) * 32 + lane);
        const uint4 lo_b = CUSTODY_LD(qs + (3 * t + 1) * 32 + lane);
        const uint4 hi = CUSTODY_LD(qs + (3 * t + 2) * 32 + lane);
        const uint4 ds = CUSTODY_LD(heads + 9 * t);
#pragma unroll
        for (custody_u32 s = 0; s < 8; s++) {
            const custody_u32 b = 8 * g + s;
            if (b >= nb) break;  // the same for every lane
            const uint4 sc = CUSTODY_LD(heads + 9 * t + 1 + s);
            const custody_u32 sb = sidx + 8;
            const signed char scale_a =
                (signed char)((custody_word_of(sc, sidx / 4) >> (8 * (sidx % 4))) & 0xffu);
            const signed char scale_b =
                (signed char)((custody_word_of(sc, sb / 4) >> (8 * (sb % 4))) & 0xffu);
            const float d = custody_half_to_float(
                (unsigned short)((custody_word_of(ds, s / 2) >> (16 * (s % 2))) & 0xffffu));
            const float da = d * (float)scale_a, db = d * (float)scale_b;
            const custody_u32 lo = custody_word_of(s < 4 ? lo_a : lo_b, s % 4);
            const custody_u32 h = (custody_word_of(hi, s / 2) >> (16 * (s % 2))) & 0xffffu;
            const custody_u32 k = 256 * b + 4 * lane;
#pragma unroll
            for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) {
                if (r >= nr) break;
                const float* xr = x + (custody_u64)(r0 + r) * cols + k;
                const float4 xa = CUSTODY_LD((const float4*)xr);
                const float4 xb = CUSTODY_LD((const float4*)(xr + 128));
                acc[r] += da * custody_dot4_q6(lo, h, 0, xa) + db * custody_dot4_q6(lo, h, 4, xb);
            }
        }
    }
    custody_gemv_store(acc, out, rows, row, r0, nr);
}

// ---- Batched decode products on integer tensor cores: Q4_K tiles × Q8 x.
//
// `custody_mmq_q4k`: out[r][o] = Σ_k W[o][k] · x[r][k], as custody_gemv_q4k_q8, for a CTA tile
// of CUSTODY_MMQ_ROWS weight rows × up to CUSTODY_MMQ_X x rows. Warp w takes the tile's rows
// 16w..16w+16 against every x row of the tile: per sub-block of 32 and per 8 x rows, one
// m16n8k32 int8 MMA gives the 16 × 8 integer dot products of the weights' 4-bit quants with x's
// int8 ones, which each lane scales into its f32 accumulators — d·sc · d_x · dot − dmin·m · s_x
// (a Q4_K value is d·sc·q − dmin·m; x's block is d_x·q_x with sum s_x = d_x·Σq_x). The
// fragments come straight from the layouts: lane (g, t) = (lane / 4, lane % 4) holds, of weight
// row g (and g + 8), the tile word of lane 8c + t (elements 4t.. of sub-blocks 2c and 2c + 1:
// its low and high nibbles, MMA registers a0/a1) and of lane 8c + 4 + t (elements 16 + 4t..,
// a2/a3); of x row g the 8-byte word at 8c + t (b0, both sub-blocks) and 8c + 4 + t (b1). Each
// of those loads is a warp's contiguous 64 bytes per row (weights) or 32 (x), sectors whole.
// The heads (16 bytes a super-block and row) and x's scales (64 bytes a super-block and row)
// are loaded whole by the lanes of a row and shuffled to the lanes that use them. Rows past
// `rows` and x rows past `n` are read as the last one and not stored. Grid
// (ceil(rows / 64), ceil(n / 64)), block (128).
#define CUSTODY_MMQ_ROWS 64u
#define CUSTODY_MMQ_X 64u

__device__ __forceinline__ uint4 custody_shfl_u4(uint4 v, custody_u32 src) {
    return make_uint4(__shfl_sync(0xffffffffu, v.x, src), __shfl_sync(0xffffffffu, v.y, src),
                      __shfl_sync(0xffffffffu, v.z, src), __shfl_sync(0xffffffffu, v.w, src));
}

__device__ __forceinline__ float4 custody_shfl_f4(float4 v, custody_u32 src) {
    return make_float4(__shfl_sync(0xffffffffu, v.x, src), __shfl_sync(0xffffffffu, v.y, src),
                       __shfl_sync(0xffffffffu, v.z, src), __shfl_sync(0xffffffffu, v.w, src));
}

// One warp's 16 weight rows (`row_a` = its first + g, and row_a + 8) of a Q4_K matrix against
// x rows x0..x0 + nx: the lane's accumulators, acc[j][i] for C element i of x rows 8j.. (see
// custody_mmq_q4k). The whole warp calls it.
__device__ __forceinline__ void custody_mmq_q4k_warp(const uint4* heads, const uint4* qs,
                                                     custody_u32 rows, custody_u32 cols,
                                                     custody_u32 row_a, const uint2* xq,
                                                     const float4* xs, custody_u32 n,
                                                     custody_u32 x0, custody_u32 nx,
                                                     float (*acc)[4]) {
    const custody_u32 lane = threadIdx.x % 32;
    const custody_u32 g = lane / 4, t = lane % 4;
    const custody_u32 nb = cols / 256, groups = (nb + 3) / 4;
    const custody_u32 row_b = row_a + 8;
    const custody_u32 ra = row_a < rows ? row_a : rows - 1, rb = row_b < rows ? row_b : rows - 1;
#pragma unroll
    for (custody_u32 j = 0; j < CUSTODY_MMQ_X / 8; j++)
        for (custody_u32 i = 0; i < 4; i++) acc[j][i] = 0.0f;
    for (custody_u32 gi = 0; gi < groups; gi++) {
        const custody_u64 ta = (custody_u64)ra * groups + gi, tb = (custody_u64)rb * groups + gi;
        // Lane (g, t) holds its rows' heads of the group's super-block t (padding blocks are
        // zero heads in the tiles: always in bounds).
        const uint4 ha = CUSTODY_LD(heads + 4 * ta + t), hb = CUSTODY_LD(heads + 4 * tb + t);
        for (custody_u32 c = 0; c < 4; c++) {
            const uint4 wa_lo = CUSTODY_LD(qs + 32 * ta + 8 * c + t);
            const uint4 wa_hi = CUSTODY_LD(qs + 32 * ta + 8 * c + 4 + t);
            const uint4 wb_lo = CUSTODY_LD(qs + 32 * tb + 8 * c + t);
            const uint4 wb_hi = CUSTODY_LD(qs + 32 * tb + 8 * c + 4 + t);
            for (custody_u32 s = 0; s < 4; s++) {
                const custody_u32 b = 4 * gi + s;
                if (b >= nb) break;  // the same for every lane
                const CustodyQ4kScales sa = custody_q4k_scales(custody_shfl_u4(ha, 4 * g + s), c);
                const CustodyQ4kScales sb = custody_q4k_scales(custody_shfl_u4(hb, 4 * g + s), c);
                const custody_u32 w[4] = {custody_word_of(wa_lo, s), custody_word_of(wb_lo, s),
                                          custody_word_of(wa_hi, s), custody_word_of(wb_hi, s)};
                for (custody_u32 j = 0; j < CUSTODY_MMQ_X / 8; j++) {
                    if (8 * j >= nx) break;  // the same for every lane
                    const custody_u32 xr = x0 + 8 * j + g < n ? x0 + 8 * j + g : n - 1;
                    const custody_u64 xb = (custody_u64)xr * nb + b;
                    const uint2 b_lo = CUSTODY_LD(xq + 32 * xb + 8 * c + t);
                    const uint2 b_hi = CUSTODY_LD(xq + 32 * xb + 8 * c + 4 + t);
                    // x row g's scales of sub-block pair t, then the pair c of this lane's two C
                    // columns (x rows 2t and 2t + 1 of the 8).
                    const float4 mine = CUSTODY_LD(xs + 4 * xb + t);
                    const float4 xa = custody_shfl_f4(mine, 4 * (2 * t) + c);
                    const float4 xc = custody_shfl_f4(mine, 4 * (2 * t + 1) + c);
#pragma unroll
                    for (custody_u32 h = 0; h < 2; h++) {
                        const custody_u32 sh = 4 * h;
                        const custody_u32 a[4] = {(w[0] >> sh) & 0x0f0f0f0fu, (w[1] >> sh) & 0x0f0f0f0fu,
                                                  (w[2] >> sh) & 0x0f0f0f0fu, (w[3] >> sh) & 0x0f0f0f0fu};
                        const custody_u32 bb[2] = {h ? b_lo.y : b_lo.x, h ? b_hi.y : b_hi.x};
                        const int zero[4] = {0, 0, 0, 0};
                        int dot[4];
                        custody_mma_m16n8k32_s8(dot, a, bb, zero);
                        const float da = h ? sa.d_hi : sa.d_lo, ma = h ? sa.m_hi : sa.m_lo;
                        const float db = h ? sb.d_hi : sb.d_lo, mb = h ? sb.m_hi : sb.m_lo;
                        const float dxa = h ? xa.z : xa.x, sxa = h ? xa.w : xa.y;
                        const float dxc = h ? xc.z : xc.x, sxc = h ? xc.w : xc.y;
                        acc[j][0] += da * dxa * (float)dot[0] - ma * sxa;
                        acc[j][1] += da * dxc * (float)dot[1] - ma * sxc;
                        acc[j][2] += db * dxa * (float)dot[2] - mb * sxa;
                        acc[j][3] += db * dxc * (float)dot[3] - mb * sxc;
                    }
                }
            }
        }
    }
}

// The warp's accumulators stored: out[x][row] for its rows and x rows (within `rows`, `nx`).
__device__ __forceinline__ void custody_mmq_store(float (*acc)[4], float* out, custody_u32 rows,
                                                  custody_u32 row_a, custody_u32 x0,
                                                  custody_u32 nx) {
    const custody_u32 t = threadIdx.x % 4;
    const custody_u32 row_b = row_a + 8;
#pragma unroll
    for (custody_u32 j = 0; j < CUSTODY_MMQ_X / 8; j++) {
        const custody_u32 xa = 8 * j + 2 * t, xc = xa + 1;
        if (xa < nx && row_a < rows) CUSTODY_ST(out + (custody_u64)(x0 + xa) * rows + row_a, acc[j][0]);
        if (xc < nx && row_a < rows) CUSTODY_ST(out + (custody_u64)(x0 + xc) * rows + row_a, acc[j][1]);
        if (xa < nx && row_b < rows) CUSTODY_ST(out + (custody_u64)(x0 + xa) * rows + row_b, acc[j][2]);
        if (xc < nx && row_b < rows) CUSTODY_ST(out + (custody_u64)(x0 + xc) * rows + row_b, acc[j][3]);
    }
}

extern "C" __global__ void custody_mmq_q4k(const uint4* heads, const uint4* qs, custody_u32 rows,
                                          custody_u32 cols, const uint2* xq, const float4* xs,
                                          custody_u32 n, float* out) {
    const custody_u32 warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
    const custody_u32 row_a = blockIdx.x * CUSTODY_MMQ_ROWS + 16 * warp + g;
    const custody_u32 x0 = blockIdx.y * CUSTODY_MMQ_X;
    const custody_u32 nx = n - x0 < CUSTODY_MMQ_X ? n - x0 : CUSTODY_MMQ_X;
    float acc[CUSTODY_MMQ_X / 8][4];
    custody_mmq_q4k_warp(heads, qs, rows, cols, row_a, xq, xs, n, x0, nx, acc);
    custody_mmq_store(acc, out, rows, row_a, x0, nx);
}

// Q, K and V in one launch: CTAs 0..ceil(q_rows / 64) take Q's rows, the next ceil(kv_rows / 64)
// K's, the rest V's (one matrix per CTA). Grid (ceil(q_rows / 64) + 2 ceil(kv_rows / 64),
// ceil(n / 64)), block (128).
extern "C" __global__ void custody_mmq_q4k_qkv(const uint4* q_heads, const uint4* q_qs,
                                              custody_u32 q_rows, const uint4* k_heads,
                                              const uint4* k_qs, const uint4* v_heads,
                                              const uint4* v_qs, custody_u32 kv_rows,
                                              custody_u32 cols, const uint2* xq,
                                              const float4* xs, custody_u32 n, float* q_out,
                                              float* k_out, float* v_out) {
    const custody_u32 warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
    const custody_u32 q_ctas = (q_rows + CUSTODY_MMQ_ROWS - 1) / CUSTODY_MMQ_ROWS;
    const custody_u32 kv_ctas = (kv_rows + CUSTODY_MMQ_ROWS - 1) / CUSTODY_MMQ_ROWS;
    custody_u32 b = blockIdx.x;
    const uint4 *heads = q_heads, *qs = q_qs;
    custody_u32 rows = q_rows;
    float* out = q_out;
    if (b >= q_ctas + kv_ctas) {
        b -= q_ctas + kv_ctas, heads = v_heads, qs = v_qs, rows = kv_rows, out = v_out;
    } else if (b >= q_ctas) {
        b -= q_ctas, heads = k_heads, qs = k_qs, rows = kv_rows, out = k_out;
    }
    const custody_u32 row_a = b * CUSTODY_MMQ_ROWS + 16 * warp + g;
    const custody_u32 x0 = blockIdx.y * CUSTODY_MMQ_X;
    const custody_u32 nx = n - x0 < CUSTODY_MMQ_X ? n - x0 : CUSTODY_MMQ_X;
    float acc[CUSTODY_MMQ_X / 8][4];
    custody_mmq_q4k_warp(heads, qs, rows, cols, row_a, xq, xs, n, x0, nx, acc);
    custody_mmq_store(acc, out, rows, row_a, x0, nx);
}

// gate and up with the SwiGLU: a CTA takes 32 output rows — warps 0 and 1 their gate products,
// warps 2 and 3 their up products, which go through shared memory to the gate warps, which
// store silu(gate) · up. Grid (ceil(rows / 32), ceil(n / 64)), block (128).
extern "C" __global__ void custody_mmq_q4k_swiglu(const uint4* gate_heads, const uint4* gate_qs,
                                                 const uint4* up_heads, const uint4* up_qs,
                                                 custody_u32 rows, custody_u32 cols,
                                                 const uint2* xq, const float4* xs, custody_u32 n,
                                                 float* out) {
    __shared__ float up_s[CUSTODY_MMQ_ROWS / 2][CUSTODY_MMQ_X + 1];
    const custody_u32 warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const bool gate = warp < 2;
    const custody_u32 local = 16 * (warp % 2) + g;  // the lane's first row within the 32
    const custody_u32 row_a = blockIdx.x * (CUSTODY_MMQ_ROWS / 2) + local;
    const custody_u32 x0 = blockIdx.y * CUSTODY_MMQ_X;
    const custody_u32 nx = n - x0 < CUSTODY_MMQ_X ? n - x0 : CUSTODY_MMQ_X;
    float acc[CUSTODY_MMQ_X / 8][4];
    custody_mmq_q4k_warp(gate ? gate_heads : up_heads, gate ? gate_qs : up_qs, rows, cols, row_a,
                         xq, xs, n, x0, nx, acc);
    if (!gate) {
#pragma unroll
        for (custody_u32 j = 0; j < CUSTODY_MMQ_X / 8; j++) {
            up_s[local][8 * j + 2 * t] = acc[j][0];
            up_s[local][8 * j + 2 * t + 1] = acc[j][1];
            up_s[local + 8][8 * j + 2 * t] = acc[j][2];
            up_s[local + 8][8 * j + 2 * t + 1] = acc[j][3];
        }
    }
    __syncthreads();
    if (!gate) return;  // per warp: no collective follows
#pragma unroll
    for (custody_u32 j = 0; j < CUSTODY_MMQ_X / 8; j++) {
        const custody_u32 xs_[2] = {8 * j + 2 * t, 8 * j + 2 * t + 1};
        for (custody_u32 i = 0; i < 4; i++) {
            const float gv = acc[j][i];
            const float u = up_s[local + 8 * (i / 2)][xs_[i % 2]];
            acc[j][i] = gv / (1.0f + expf(-gv)) * u;
        }
    }
    custody_mmq_store(acc, out, rows, row_a, x0, nx);
}

// Q8_0 in `custody_cuda::repack::q8_0`'s tiles (groups of 8 blocks = 256 elements): heads[t] the 8
// blocks' f16 d; qs[32t + l] lane l's 8 quants, elements 4l..4l+3 (block l / 8) and
// 128+4l..128+4l+3 (block 4 + l / 8) of the group. One 256-byte coalesced warp load per group,
// two contiguous 512-byte x loads; a half of a lane's values lying past `cols` (the last group's
// padding) adds nothing and reads no x. Grid and block as custody_gemv_q4k.
extern "C" __global__ void custody_gemv_q8_0(const uint4* heads, const uint2* qs, custody_u32 rows,
                                            custody_u32 cols, const float* x, custody_u32 n,
                                            float* out) {
    const custody_u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const custody_u32 row = blockIdx.x * CUSTODY_GEMV_WARPS + warp;
    const custody_u32 r0 = blockIdx.y * CUSTODY_GEMV_BATCH;
    if (row >= rows) return;  // the whole warp: no collective below is left half-reached
    const custody_u32 nr = n - r0 < CUSTODY_GEMV_BATCH ? n - r0 : CUSTODY_GEMV_BATCH;
    const custody_u32 groups = (cols / 32 + 7) / 8;
    float acc[CUSTODY_GEMV_BATCH];
#pragma unroll
    for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) acc[r] = 0.0f;
    for (custody_u32 g = 0; g < groups; g++) {
        const custody_u32 ka = 256 * g + 4 * lane, kb = ka + 128;
        if (ka >= cols) continue;  // padding: per lane, no collective inside the loop
        const custody_u64 t = (custody_u64)row * groups + g;
        const uint2 q = CUSTODY_LD(qs + 32 * t + lane);
        const uint4 ds = CUSTODY_LD(heads + t);
        const custody_u32 ba = lane / 8, bb = 4 + lane / 8;
        const float da = custody_half_to_float(
            (unsigned short)((custody_word_of(ds, ba / 2) >> (16 * (ba % 2))) & 0xffffu));
        const float db = custody_half_to_float(
            (unsigned short)((custody_word_of(ds, bb / 2) >> (16 * (bb % 2))) & 0xffffu));
        const bool second = kb < cols;
#define CUSTODY_Q8(w, i) ((float)(signed char)(((w) >> (8 * (i))) & 0xffu))
#pragma unroll
        for (custody_u32 r = 0; r < CUSTODY_GEMV_BATCH; r++) {
            if (r >= nr) break;
            const float* xr = x + (custody_u64)(r0 + r) * cols;
            const float4 xa = CUSTODY_LD((const float4*)(xr + ka));
            float v = da * ((CUSTODY_Q8(q.x, 0) * xa.x + CUSTODY_Q8(q.x, 1) * xa.y) +
                            (CUSTODY_Q8(q.x, 2) * xa.z + CUSTODY_Q8(q.x, 3) * xa.w));
            if (second) {
                const float4 xb = CUSTODY_LD((const float4*)(xr + kb));
                v += db * ((CUSTODY_Q8(q.y, 0) * xb.x + CUSTODY_Q8(q.y, 1) * xb.y) +
                           (CUSTODY_Q8(q.y, 2) * xb.z + CUSTODY_Q8(q.y, 3) * xb.w));
            }
            acc[r] += v;
        }
#undef CUSTODY_Q8
    }
    custody_gemv_store(acc, out, rows, row, r0, nr);
}

// The embedding rows of `tokens`: out[r] = row tokens[r] of `w` (`rows × cols` in `dtype`),
// dequantized to f32. Grid (n), block (128).
extern "C" __global__ void custody_embed(const unsigned char* w, custody_u32 dtype, custody_u32 cols,
                                        const custody_u32* tokens, float* out) {
    // The table row's bytes are read by `custody_weight`'s per-element dequantizer and are not
    // counted by the performance model (one row per token: ~1 KB of a step's hundreds of MB).
    const custody_u32 r = blockIdx.x;
    const custody_u32 token = CUSTODY_LD(tokens + r);
    float* o = out + (custody_u64)r * cols;
    for (custody_u32 k = threadIdx.x; k < cols; k += CUSTODY_OPS_THREADS)
        CUSTODY_ST(o + k, custody_weight(w, dtype, cols, token, k));
}

// The rows the output head computes: dst[i] = src[idx[i]] (`width` floats each) — the rows
// whose logits a step returns, so that a prompt's head runs once, not once per token.
// Grid (n), block (128).
extern "C" __global__ void custody_gather_rows(const float* src, const custody_u32* idx,
                                              custody_u32 width, float* dst) {
    const custody_u64 from = (custody_u64)CUSTODY_LD(idx + blockIdx.x) * width;
    const custody_u64 to = (custody_u64)blockIdx.x * width;
    for (custody_u32 i = threadIdx.x; i < width; i += CUSTODY_OPS_THREADS)
        CUSTODY_ST(dst + to + i, CUSTODY_LD(src + from + i));
}

// KV page gather/scatter of the transfer path: copy chunk i (`len[i]` bytes) from
// `src + src_off[i]` to `dst + dst_off[i]` — a page's K/V chunks into a contiguous staging
// buffer (gather) or back (scatter). Grid (n_chunks), block (128).
extern "C" __global__ void custody_copy_chunks(const unsigned char* src, const custody_u64* src_off,
                                              unsigned char* dst, const custody_u64* dst_off,
                                              const custody_u64* len) {
    const custody_u32 i = blockIdx.x;
    const unsigned char* s = src + src_off[i];
    unsigned char* d = dst + dst_off[i];
    for (custody_u64 b = threadIdx.x; b < len[i]; b += CUSTODY_OPS_THREADS) d[b] = s[b];
}

// Synthetic Q4_K weights made on the device, for `custody gpu-check speed` (a model of a served
// size without writing or uploading gigabytes): `n_blocks` super-blocks, block i's 16-byte head
// (f16 d and dmin in [2^-14, 2^-13), 12 random scale bytes) at heads + i·head_stride and its
// 128 random quant bytes at qs + i·qs_stride. A block whose index within its row of
// `blocks_per_row` is at or past `real_per_row` gets a zero head (the tiles' padding: it adds
// nothing). The GGUF layout: head_stride = qs_stride = 144, qs = heads + 16; the GEMV's tiles:
// 16 and 128 (their quants' interleaving is immaterial for random bytes). Deterministic in
// `seed`. Any grid; block (128).
__device__ __forceinline__ custody_u64 custody_mix64(custody_u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void custody_fill_q4k(unsigned char* heads, custody_u64 head_stride,
                                           unsigned char* qs, custody_u64 qs_stride,
                                           custody_u64 n_blocks, custody_u32 blocks_per_row,
                                           custody_u32 real_per_row, custody_u64 seed) {
    for (custody_u64 i = (custody_u64)blockIdx.x * CUSTODY_OPS_THREADS + threadIdx.x; i < n_blocks;
         i += (custody_u64)gridDim.x * CUSTODY_OPS_THREADS) {
        const bool real = (custody_u32)(i % blocks_per_row) < real_per_row;
        custody_u64 h[2];
        const custody_u64 r0 = custody_mix64(seed ^ (i * 17 + 0)), r1 = custody_mix64(seed ^ (i * 17 + 1));
        // d, dmin: exponent field 1 (2^-14), random mantissa; then 12 random scale bytes.
        const custody_u64 d = 0x0400u | (r0 & 0x3ffu), dmin = 0x0400u | ((r0 >> 10) & 0x3ffu);
        h[0] = real ? (d | (dmin << 16) | (r0 & 0xffffffff00000000ull)) : 0;
        h[1] = real ? r1 : 0;
        unsigned char* hb = heads + i * head_stride;
        for (int b = 0; b < 16; b++) CUSTODY_ST(hb + b, (unsigned char)(h[b / 8] >> (8 * (b % 8))));
        unsigned char* qb = qs + i * qs_stride;
        for (int w = 0; w < 16; w++) {
            const custody_u64 r = custody_mix64(seed ^ (i * 17 + 2 + w));
            for (int b = 0; b < 8; b++) CUSTODY_ST(qb + 8 * w + b, (unsigned char)(r >> (8 * b)));
        }
    }
}

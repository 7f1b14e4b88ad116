// The CUDA-on-CPU launchers of Custody's kernels for the tests (`custody_tests::cuda_shim`):
// the kernel sources compiled for the host through the shim, each launched with the grid and
// block its GPU launcher uses, under a schedule seed.
#define CUSTODY_CUDA_SHIM 1
#include <stdio.h>
#include "../../kernels/cuda/attention.cu"
#include "../../kernels/cuda/checksum.cu"
#include "../../kernels/cuda/ops.cu"

namespace {
struct ChecksumArgs {
    const unsigned char* const* ptrs;
    const custody_u64* lens;
    const custody_u32* page_chunks;
    custody_u32 n_pages;
    custody_u64* out;
};

void checksum_body(void* c) {
    auto* a = static_cast<ChecksumArgs*>(c);
    custody_page_checksum(a->ptrs, a->lens, a->page_chunks, a->n_pages, a->out);
}

struct TagCheckArgs {
    const CustodyPageRef* tables;
    const custody_u32* table_off;
    const custody_u32* table_len;
    const custody_u32* n_ctx;
    const CustodyReader* readers;
    custody_u32 page_size;
    CustodyTags tags;
    CustodyVerdict* out;
};

void tag_check_body(void* c) {
    auto* a = static_cast<TagCheckArgs*>(c);
    custody_tag_check(a->tables, a->table_off, a->table_len, a->n_ctx, a->readers, a->page_size,
                      a->tags, a->out);
}

}  // namespace

extern "C" int custody_shim_page_checksum(const unsigned char* const* ptrs,
                                          const custody_u64* lens, const custody_u32* page_chunks,
                                          custody_u32 n_pages, custody_u64* out, uint64_t seed,
                                          char* err, size_t err_len) {
    ChecksumArgs a{ptrs, lens, page_chunks, n_pages, out};
    return custody_shim::launch(dim3(n_pages), dim3(8), seed, checksum_body, &a, err, err_len);
}

extern "C" int custody_shim_tag_check(const CustodyPageRef* tables, const custody_u32* table_off,
                                      const custody_u32* table_len, const custody_u32* n_ctx,
                                      const CustodyReader* readers, custody_u32 n_req,
                                      custody_u32 page_size, CustodyTags tags, CustodyVerdict* out,
                                      uint64_t seed, char* err, size_t err_len) {
    TagCheckArgs a{tables, table_off, table_len, n_ctx, readers, page_size, tags, out};
    return custody_shim::launch(dim3(n_req), dim3(CUSTODY_ATT_THREADS), seed, tag_check_body, &a,
                                err, err_len);
}

// The shim's own controls: a racy kernel (every thread reads and rewrites one shared cell with
// no barrier in between, so the result depends on the schedule) and a barrier only some threads
// reach.
namespace {
void race_body(void* c) {
    __shared__ float cell;
    if (threadIdx.x == 0) cell = 0.0f;
    __syncthreads();
    const float seen = cell;
    cell = seen * 0.5f + (float)threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) *static_cast<float*>(c) = cell;
}

void divergent_body(void*) {
    if (threadIdx.x < 44) __syncthreads();
}

// Warp collectives: out[t] = the sum over t's warp (butterfly), out[64 + t] = lane t+1's id
// (shuffle down; the last lane keeps its own).
void warp_sum_body(void* c) {
    auto* out = static_cast<custody_u32*>(c);
    const custody_u32 t = threadIdx.x;
    custody_u32 v = t;
    for (custody_u32 m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    out[t] = v;
    out[64 + t] = __shfl_down_sync(0xffffffffu, t, 1);
}

// Lanes 0..9 of warp 0 leave before the others' shuffle.
void warp_divergent_body(void*) {
    if (threadIdx.x < 10) return;
    (void)__shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
}  // namespace

extern "C" int custody_shim_control_warp_sum(custody_u32* out, uint64_t seed, char* err,
                                             size_t err_len) {
    return custody_shim::launch(dim3(1), dim3(64), seed, warp_sum_body, out, err, err_len);
}

extern "C" int custody_shim_control_warp_divergent(char* err, size_t err_len) {
    return custody_shim::launch(dim3(1), dim3(64), 0, warp_divergent_body, nullptr, err, err_len);
}

extern "C" int custody_shim_control_race(float* out, uint64_t seed, char* err, size_t err_len) {
    return custody_shim::launch(dim3(1), dim3(64), seed, race_body, out, err, err_len);
}

extern "C" int custody_shim_control_divergent(char* err, size_t err_len) {
    return custody_shim::launch(dim3(1), dim3(256), 0, divergent_body, nullptr, err, err_len);
}

// The forward pass's kernels and the transfer path's gather/scatter, each with its GPU grid.
namespace {
struct RowArgs {
    const float* x;
    const float* w;
    float eps;
    custody_u32 dim;
    float* out;
    const custody_u32* positions;
    custody_u32 n_heads, head_dim, n_rot;
    float freq_base;
    const float* freq_factors;
    custody_u32 neox;
};
void rms_norm_body(void* c) {
    auto* a = static_cast<RowArgs*>(c);
    custody_rms_norm(a->x, a->w, a->eps, a->dim, a->out, nullptr, nullptr);
}
void rope_body(void* c) {
    auto* a = static_cast<RowArgs*>(c);
    custody_rope(a->out, a->positions, a->n_heads, a->head_dim, a->n_rot, a->freq_base,
                 a->freq_factors, a->neox);
}
void softmax_body(void* c) {
    auto* a = static_cast<RowArgs*>(c);
    custody_softmax(a->out, a->dim);
}
struct SwigluArgs {
    float* gate;
    const float* up;
    custody_u64 n;
};
void swiglu_body(void* c) {
    auto* a = static_cast<SwigluArgs*>(c);
    custody_swiglu(a->gate, a->up, a->n);
}
struct MatvecArgs {
    const unsigned char* w;
    custody_u32 dtype, out_rows, cols;
    const float* x;
    float* out;
};
void matvec_body(void* c) {
    auto* a = static_cast<MatvecArgs*>(c);
    custody_matvec(a->w, a->dtype, a->out_rows, a->cols, a->x, a->out);
}
struct CopyArgs {
    const unsigned char* src;
    const custody_u64* src_off;
    unsigned char* dst;
    const custody_u64* dst_off;
    const custody_u64* len;
};
void copy_body(void* c) {
    auto* a = static_cast<CopyArgs*>(c);
    custody_copy_chunks(a->src, a->src_off, a->dst, a->dst_off, a->len);
}
}  // namespace

extern "C" int custody_shim_rms_norm(const float* x, const float* w, float eps, custody_u32 rows,
                                     custody_u32 dim, float* out, uint64_t seed, char* err,
                                     size_t err_len) {
    RowArgs a{x, w, eps, dim, out, nullptr, 0, 0, 0, 0.0f, nullptr, 0};
    return custody_shim::launch(dim3(rows), dim3(CUSTODY_OPS_THREADS), seed, rms_norm_body, &a,
                                err, err_len);
}

extern "C" int custody_shim_rope(float* x, const custody_u32* positions, custody_u32 rows,
                                 custody_u32 n_heads, custody_u32 head_dim, custody_u32 n_rot,
                                 float freq_base, const float* freq_factors, custody_u32 neox,
                                 uint64_t seed, char* err, size_t err_len) {
    RowArgs a{nullptr, nullptr, 0.0f, 0, x, positions, n_heads, head_dim, n_rot, freq_base,
              freq_factors, neox};
    return custody_shim::launch(dim3(rows), dim3(CUSTODY_OPS_THREADS), seed, rope_body, &a, err,
                                err_len);
}

extern "C" int custody_shim_softmax(float* x, custody_u32 rows, custody_u32 n, uint64_t seed,
                                    char* err, size_t err_len) {
    RowArgs a{nullptr, nullptr, 0.0f, n, x, nullptr, 0, 0, 0, 0.0f, nullptr, 0};
    return custody_shim::launch(dim3(rows), dim3(CUSTODY_OPS_THREADS), seed, softmax_body, &a,
                                err, err_len);
}

extern "C" int custody_shim_swiglu(float* gate, const float* up, custody_u64 n, uint64_t seed,
                                   char* err, size_t err_len) {
    SwigluArgs a{gate, up, n};
    const unsigned blocks = (unsigned)((n + CUSTODY_OPS_THREADS - 1) / CUSTODY_OPS_THREADS);
    return custody_shim::launch(dim3(blocks), dim3(CUSTODY_OPS_THREADS), seed, swiglu_body, &a,
                                err, err_len);
}

extern "C" int custody_shim_matvec(const unsigned char* w, custody_u32 dtype, custody_u32 out_rows,
                                   custody_u32 cols, const float* x, custody_u32 n, float* out,
                                   uint64_t seed, char* err, size_t err_len) {
    MatvecArgs a{w, dtype, out_rows, cols, x, out};
    return custody_shim::launch(dim3(out_rows, n), dim3(CUSTODY_OPS_THREADS), seed, matvec_body,
                                &a, err, err_len);
}

extern "C" int custody_shim_copy_chunks(const unsigned char* src, const custody_u64* src_off,
                                        unsigned char* dst, const custody_u64* dst_off,
                                        const custody_u64* len, custody_u32 n_chunks,
                                        uint64_t seed, char* err, size_t err_len) {
    CopyArgs a{src, src_off, dst, dst_off, len};
    return custody_shim::launch(dim3(n_chunks), dim3(CUSTODY_OPS_THREADS), seed, copy_body, &a,
                                err, err_len);
}

// One launcher for every kernel, by name, as the CUDA forward pass launches them through
// `custody_cuda::Device` (the test crate's `ShimDevice`): argument i in `args[6i .. 6i + 6]`,
// as the cudarc device stores it (a pointer, integer or float's bits in the first word; a
// `CustodyTags` in all six).
namespace {
struct Generic {
    const char* name;
    const uint64_t* a;
    bool known;
};
float f32_at(const uint64_t* a, size_t i) {
    const custody_u32 bits = (custody_u32)a[6 * i];
    return __uint_as_float(bits);
}
#define PTR(i, T) ((T)(uintptr_t)g->a[6 * (i)])
#define U32(i) ((custody_u32)g->a[6 * (i)])
#define U64(i) ((custody_u64)g->a[6 * (i)])
#define F32(i) (f32_at(g->a, (i)))
#define TAGS(i) (*(const CustodyTags*)(const void*)&g->a[6 * (i)])
void generic_body(void* c) {
    auto* g = static_cast<Generic*>(c);
    const char* n = g->name;
    g->known = true;
    if (!strcmp(n, "custody_embed")) {
        custody_embed(PTR(0, const unsigned char*), U32(1), U32(2), PTR(3, const custody_u32*),
                      PTR(4, float*));
    } else if (!strcmp(n, "custody_rms_norm")) {
        custody_rms_norm(PTR(0, const float*), PTR(1, const float*), F32(2), U32(3), PTR(4, float*),
                         PTR(5, unsigned char*), PTR(6, float*));
    } else if (!strcmp(n, "custody_add_rms_norm")) {
        custody_add_rms_norm(PTR(0, float*), PTR(1, const float*), PTR(2, const float*), F32(3),
                             U32(4), PTR(5, float*), PTR(6, unsigned char*), PTR(7, float*));
    } else if (!strcmp(n, "custody_matvec")) {
        custody_matvec(PTR(0, const unsigned char*), U32(1), U32(2), U32(3), PTR(4, const float*),
                       PTR(5, float*));
    } else if (!strcmp(n, "custody_gemv_q4k")) {
        custody_gemv_q4k(PTR(0, const uint4*), PTR(1, const uint4*), U32(2), U32(3),
                         PTR(4, const float*), U32(5), PTR(6, float*));
    } else if (!strcmp(n, "custody_rope")) {
        custody_rope(PTR(0, float*), PTR(1, const custody_u32*), U32(2), U32(3), U32(4), F32(5),
                     PTR(6, const float*), U32(7));
    } else if (!strcmp(n, "custody_add_rows")) {
        custody_add_rows(PTR(0, float*), PTR(1, const float*), U32(2), U64(3));
    } else if (!strcmp(n, "custody_kv_write")) {
        custody_kv_write(PTR(0, const float*), PTR(1, const float*), PTR(2, const custody_u32*),
                         PTR(3, const custody_u32*), U32(4), U32(5), U32(6),
                         PTR(7, unsigned short*), PTR(8, unsigned short*));
    } else if (!strcmp(n, "custody_flash_decode")) {
        custody_flash_decode(
            PTR(0, const float*), PTR(1, const unsigned short*), PTR(2, const unsigned short*),
            PTR(3, const CustodyPageRef*), PTR(4, const custody_u32*), PTR(5, const custody_u32*),
            PTR(6, const custody_u32*), PTR(7, const CustodyReader*), U32(8), U32(9), U32(10),
            U32(11), TAGS(12), U32(13), PTR(14, float*), PTR(15, custody_u32*),
            PTR(16, custody_u32*), PTR(17, float*), PTR(18, CustodyVerdict*),
            PTR(19, const custody_u32*), PTR(20, unsigned char*), PTR(21, float*));
    } else if (!strcmp(n, "custody_flash_prefill")) {
        custody_flash_prefill(
            PTR(0, const float*), PTR(1, const unsigned short*), PTR(2, const unsigned short*),
            PTR(3, const CustodyPageRef*), PTR(4, const custody_u32*), PTR(5, const custody_u32*),
            PTR(6, const custody_u32*), PTR(7, const CustodyReader*), U32(8), U32(9), U32(10),
            U32(11), TAGS(12), PTR(13, const custody_u32*), PTR(14, float*),
            PTR(15, CustodyVerdict*));
    } else if (!strcmp(n, "custody_tag_apply")) {
        custody_tag_apply(PTR(0, const unsigned char*), U32(1), U32(2), PTR(3, custody_u32*),
                          PTR(4, custody_u64*), PTR(5, custody_u64*), PTR(6, custody_u32*),
                          PTR(7, custody_u32*));
    } else if (!strcmp(n, "custody_tag_check")) {
        custody_tag_check(PTR(0, const CustodyPageRef*), PTR(1, const custody_u32*),
                          PTR(2, const custody_u32*), PTR(3, const custody_u32*),
                          PTR(4, const CustodyReader*), U32(5), TAGS(6), PTR(7, CustodyVerdict*));
    } else if (!strcmp(n, "custody_gemv_q6k")) {
        custody_gemv_q6k(PTR(0, const uint4*), PTR(1, const uint4*), U32(2), U32(3),
                         PTR(4, const float*), U32(5), PTR(6, float*));
    } else if (!strcmp(n, "custody_gemv_q8_0")) {
        custody_gemv_q8_0(PTR(0, const uint4*), PTR(1, const uint2*), U32(2), U32(3),
                          PTR(4, const float*), U32(5), PTR(6, float*));
    } else if (!strcmp(n, "custody_dequant_f16")) {
        custody_dequant_f16(PTR(0, const unsigned char*), U32(1), U32(2), PTR(3, unsigned short*));
    } else if (!strcmp(n, "custody_to_f16")) {
        custody_to_f16(PTR(0, const float*), PTR(1, unsigned short*), U64(2));
    } else if (!strcmp(n, "custody_gather_rows")) {
        custody_gather_rows(PTR(0, const float*), PTR(1, const custody_u32*), U32(2),
                            PTR(3, float*));
    } else if (!strcmp(n, "custody_rope_kv_write")) {
        custody_rope_kv_write(PTR(0, float*), PTR(1, float*), PTR(2, const float*),
                              PTR(3, const custody_u32*), U32(4), U32(5), U32(6), U32(7), F32(8),
                              PTR(9, const float*), U32(10), PTR(11, const custody_u32*),
                              PTR(12, const custody_u32*), U32(13), PTR(14, unsigned short*),
                              PTR(15, unsigned short*));
    } else if (!strcmp(n, "custody_gemv_q4k_qkv")) {
        custody_gemv_q4k_qkv(PTR(0, const uint4*), PTR(1, const uint4*), U32(2),
                             PTR(3, const uint4*), PTR(4, const uint4*), PTR(5, const uint4*),
                             PTR(6, const uint4*), U32(7), U32(8), PTR(9, const float*), U32(10),
                             PTR(11, float*), PTR(12, float*), PTR(13, float*));
    } else if (!strcmp(n, "custody_quantize_q8")) {
        custody_quantize_q8(PTR(0, const float*), U32(1), PTR(2, unsigned char*), PTR(3, float*));
    } else if (!strcmp(n, "custody_mmq_q4k")) {
        custody_mmq_q4k(PTR(0, const uint4*), PTR(1, const uint4*), U32(2), U32(3),
                        PTR(4, const uint2*), PTR(5, const float4*), U32(6), PTR(7, float*));
    } else if (!strcmp(n, "custody_mmq_q4k_qkv")) {
        custody_mmq_q4k_qkv(PTR(0, const uint4*), PTR(1, const uint4*), U32(2),
                            PTR(3, const uint4*), PTR(4, const uint4*), PTR(5, const uint4*),
                            PTR(6, const uint4*), U32(7), U32(8), PTR(9, const uint2*),
                            PTR(10, const float4*), U32(11), PTR(12, float*), PTR(13, float*),
                            PTR(14, float*));
    } else if (!strcmp(n, "custody_mmq_q4k_swiglu")) {
        custody_mmq_q4k_swiglu(PTR(0, const uint4*), PTR(1, const uint4*), PTR(2, const uint4*),
                               PTR(3, const uint4*), U32(4), U32(5), PTR(6, const uint2*),
                               PTR(7, const float4*), U32(8), PTR(9, float*));
    } else if (!strcmp(n, "custody_gemv_q4k_q8")) {
        custody_gemv_q4k_q8(PTR(0, const uint4*), PTR(1, const uint4*), U32(2), U32(3),
                            PTR(4, const uint2*), PTR(5, const float4*), U32(6), PTR(7, float*));
    } else if (!strcmp(n, "custody_gemv_q4k_q8_qkv")) {
        custody_gemv_q4k_q8_qkv(PTR(0, const uint4*), PTR(1, const uint4*), U32(2),
                                PTR(3, const uint4*), PTR(4, const uint4*), PTR(5, const uint4*),
                                PTR(6, const uint4*), U32(7), U32(8), PTR(9, const uint2*),
                                PTR(10, const float4*), U32(11), PTR(12, float*), PTR(13, float*),
                                PTR(14, float*));
    } else if (!strcmp(n, "custody_gemv_q4k_q8_swiglu")) {
        custody_gemv_q4k_q8_swiglu(PTR(0, const uint4*), PTR(1, const uint4*),
                                   PTR(2, const uint4*), PTR(3, const uint4*), U32(4), U32(5),
                                   PTR(6, const uint2*), PTR(7, const float4*), U32(8),
                                   PTR(9, float*));
    } else if (!strcmp(n, "custody_gemv_q4k_swiglu")) {
        custody_gemv_q4k_swiglu(PTR(0, const uint4*), PTR(1, const uint4*), PTR(2, const uint4*),
                                PTR(3, const uint4*), U32(4), U32(5), PTR(6, const float*), U32(7),
                                PTR(8, float*));
    } else if (!strcmp(n, "custody_fill_q4k")) {
        custody_fill_q4k(PTR(0, unsigned char*), U64(1), PTR(2, unsigned char*), U64(3), U64(4),
                         U32(5), U32(6), U64(7));
    } else if (!strcmp(n, "custody_swiglu")) {
        custody_swiglu(PTR(0, float*), PTR(1, const float*), U64(2));
    } else if (!strcmp(n, "custody_softmax")) {
        custody_softmax(PTR(0, float*), U32(1));
    } else if (!strcmp(n, "custody_page_checksum")) {
        custody_page_checksum(PTR(0, const unsigned char* const*), PTR(1, const custody_u64*),
                              PTR(2, const custody_u32*), U32(3), PTR(4, custody_u64*));
    } else if (!strcmp(n, "custody_copy_chunks")) {
        custody_copy_chunks(PTR(0, const unsigned char*), PTR(1, const custody_u64*),
                            PTR(2, unsigned char*), PTR(3, const custody_u64*),
                            PTR(4, const custody_u64*));
    } else {
        g->known = false;
    }
}
#undef PTR
#undef U32
#undef U64
#undef F32
#undef TAGS
}  // namespace

extern "C" int custody_shim_launch(const char* name, const unsigned* grid, const unsigned* block,
                                   const uint64_t* args, uint64_t seed, char* err,
                                   size_t err_len) {
    Generic g{name, args, true};
    const int rc = custody_shim::launch(dim3(grid[0], grid[1], grid[2]),
                                        dim3(block[0], block[1], block[2]), seed, generic_body,
                                        &g, err, err_len);
    if (rc == 0 && !g.known) {
        snprintf(err, err_len, "no such kernel: %s", name);
        return -1;
    }
    return rc;
}

// The performance model's counts (cuda_shim.h): begin before a launch, end after it.
extern "C" void custody_shim_count_begin() { custody_shim::count_begin(); }
extern "C" void custody_shim_count_end(custody_shim::Counts* out) { *out = custody_shim::count_end(); }

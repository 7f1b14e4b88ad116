// The CUDA-on-CPU launchers of Custody's kernels for the tests (`custody_tests::cuda_shim`):
// the kernel sources compiled for the host through the shim, each launched with the grid and
// block its GPU launcher uses, under a schedule seed.
#define CUSTODY_CUDA_SHIM 1
#include "../../kernels/cuda/attention.cu"
#include "../../kernels/cuda/checksum.cu"

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
    const custody_u64* owners;
    custody_u32 page_size;
    CustodyTags tags;
    CustodyVerdict* out;
};

void tag_check_body(void* c) {
    auto* a = static_cast<TagCheckArgs*>(c);
    custody_tag_check(a->tables, a->table_off, a->table_len, a->n_ctx, a->owners, a->page_size,
                      a->tags, a->out);
}

struct AttentionArgs {
    const float* q;
    const unsigned short* k_cache;
    const unsigned short* v_cache;
    TagCheckArgs check;
    custody_u32 n_heads, n_kv_heads, head_dim;
    float* out;
};

void attention_body(void* c) {
    auto* a = static_cast<AttentionArgs*>(c);
    custody_paged_attention_decode(a->q, a->k_cache, a->v_cache, a->check.tables,
                                   a->check.table_off, a->check.table_len, a->check.n_ctx,
                                   a->check.owners, a->n_heads, a->n_kv_heads, a->head_dim,
                                   a->check.page_size, a->check.tags, a->out, a->check.out);
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
                                      const custody_u64* owners, custody_u32 n_req,
                                      custody_u32 page_size, CustodyTags tags, CustodyVerdict* out,
                                      uint64_t seed, char* err, size_t err_len) {
    TagCheckArgs a{tables, table_off, table_len, n_ctx, owners, page_size, tags, out};
    return custody_shim::launch(dim3(n_req), dim3(CUSTODY_ATT_THREADS), seed, tag_check_body, &a,
                                err, err_len);
}

extern "C" int custody_shim_paged_attention_decode(
    const float* q, const unsigned short* k_cache, const unsigned short* v_cache,
    const CustodyPageRef* tables, const custody_u32* table_off, const custody_u32* table_len,
    const custody_u32* n_ctx, const custody_u64* owners, custody_u32 n_req, custody_u32 n_heads,
    custody_u32 n_kv_heads, custody_u32 head_dim, custody_u32 page_size, CustodyTags tags,
    float* out, CustodyVerdict* verdicts, uint64_t seed, char* err, size_t err_len) {
    AttentionArgs a{q,
                    k_cache,
                    v_cache,
                    TagCheckArgs{tables, table_off, table_len, n_ctx, owners, page_size, tags,
                                 verdicts},
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    out};
    return custody_shim::launch(dim3(n_heads, n_req), dim3(CUSTODY_ATT_THREADS), seed,
                                attention_body, &a, err, err_len);
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
}  // namespace

extern "C" int custody_shim_control_race(float* out, uint64_t seed, char* err, size_t err_len) {
    return custody_shim::launch(dim3(1), dim3(64), seed, race_body, out, err, err_len);
}

extern "C" int custody_shim_control_divergent(char* err, size_t err_len) {
    return custody_shim::launch(dim3(1), dim3(256), 0, divergent_body, nullptr, err, err_len);
}

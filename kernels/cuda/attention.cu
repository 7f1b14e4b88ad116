// Paged attention that checks each page's tag before it reads a single slot, and the tag check
// alone. The verdict is the CPU's (`custody_kernels::attention::check_tags`) exactly: the first
// failing page in block-table order, the same checks in the same order, the same reported
// values. A request that fails gets a verdict instead of output: its blocks return before any
// K/V load, and its output rows are not written.
#include "custody.cuh"

// Threads per block of both kernels (the reductions below assume it).
#define CUSTODY_ATT_THREADS 128u
// Longest context one attention block holds scores for (shared memory: 4 bytes per slot).
#define CUSTODY_ATT_MAX_CTX 8192u
#define CUSTODY_NO_PAGE 0xFFFFFFFFu

// The verdict for page `i` of a block table (0 if it may be read), as `check_tags` orders its
// checks. `i < need` and the table is long enough (checked by the caller).
__device__ CustodyVerdict custody_check_page(const CustodyPageRef* table, custody_u32 i,
                                             custody_u32 n_ctx, custody_u32 page_size,
                                             const CustodyTags* t, custody_u64 owner) {
    CustodyVerdict v;
    v.code = CUSTODY_OK;
    v.page = table[i].page;
    v.a = 0;
    v.b = 0;
    const custody_u32 p = table[i].page;
    if (p >= t->n_pages) {
        v.code = CUSTODY_PAGE_OUT_OF_RANGE;
        v.a = t->n_pages;
        return v;
    }
    const custody_u32 found = t->generation[p];
    if (found != table[i].generation) {
        v.code = CUSTODY_STALE_GENERATION;
        v.a = table[i].generation;
        v.b = found;
        return v;
    }
    if (t->owner[p] != owner) {
        v.code = CUSTODY_FOREIGN_OWNER;
        v.a = owner;
        v.b = t->owner[p];
        return v;
    }
    const custody_u32 left = n_ctx - i * page_size;
    const custody_u32 attended = left < page_size ? left : page_size;
    if (t->filled[p] < attended) {
        v.code = CUSTODY_UNWRITTEN_SLOT;
        v.a = t->filled[p];
        v.b = found;
        return v;
    }
    if (t->stamp_owner[p] != owner || t->stamp_generation[p] != found) {
        v.code = CUSTODY_IN_BAND_MISMATCH;
        v.a = t->stamp_owner[p];
        v.b = t->stamp_generation[p];
        return v;
    }
    return v;
}

// The whole block decides one request's verdict: each thread checks a share of the pages, the
// first failing index is reduced through shared memory, thread 0 writes the verdict to
// `*verdict` (shared). Every thread of the block must call it (it has barriers).
__device__ void custody_check_request(const CustodyPageRef* table, custody_u32 table_len,
                                      custody_u32 n_ctx, custody_u32 page_size,
                                      const CustodyTags* tags, custody_u64 owner,
                                      custody_u32* first_bad, CustodyVerdict* verdict) {
    const custody_u32 t = threadIdx.x;
    const custody_u32 need = (n_ctx + page_size - 1) / page_size;
    custody_u32 mine = CUSTODY_NO_PAGE;
    if (table_len >= need) {
        for (custody_u32 i = t; i < need; i += CUSTODY_ATT_THREADS) {
            if (custody_check_page(table, i, n_ctx, page_size, tags, owner).code != CUSTODY_OK) {
                mine = i; // ascending per thread: the first is this thread's smallest
                break;
            }
        }
    }
    first_bad[t] = mine;
    __syncthreads();
    for (custody_u32 half = CUSTODY_ATT_THREADS / 2; half > 0; half /= 2) {
        if (t < half && first_bad[t + half] < first_bad[t]) first_bad[t] = first_bad[t + half];
        __syncthreads();
    }
    if (t == 0) {
        if (table_len < need) {
            verdict->code = CUSTODY_BLOCK_TABLE_TOO_SHORT;
            verdict->page = 0;
            verdict->a = table_len;
            verdict->b = need;
        } else if (first_bad[0] == CUSTODY_NO_PAGE) {
            verdict->code = CUSTODY_OK;
            verdict->page = 0;
            verdict->a = 0;
            verdict->b = 0;
        } else {
            *verdict = custody_check_page(table, first_bad[0], n_ctx, page_size, tags, owner);
        }
    }
    __syncthreads();
}

// Tag check alone. Grid (n_req), block (CUSTODY_ATT_THREADS). Request r's block table is
// `tables[table_off[r] .. table_off[r] + table_len[r]]`; it attends `n_ctx[r]` slots as
// `owners[r]`.
extern "C" __global__ void custody_tag_check(const CustodyPageRef* tables,
                                             const custody_u32* table_off,
                                             const custody_u32* table_len,
                                             const custody_u32* n_ctx, const custody_u64* owners,
                                             custody_u32 page_size, CustodyTags tags,
                                             CustodyVerdict* out) {
    __shared__ custody_u32 first_bad[CUSTODY_ATT_THREADS];
    __shared__ CustodyVerdict verdict;
    const custody_u32 r = blockIdx.x;
    custody_check_request(tables + table_off[r], table_len[r], n_ctx[r], page_size, &tags,
                          owners[r], first_bad, &verdict);
    if (threadIdx.x == 0) out[r] = verdict;
}

// Decode attention (one query per request), causal over the request's `n_ctx[r]` slots.
// Grid (n_heads, n_req), block (CUSTODY_ATT_THREADS). `q`, `out`: `n_req × n_heads × head_dim`
// f32; caches: f16 bits, `[page][kv_head][slot][head_dim]` (`PageGeometry::offset`). Every
// block first runs the request's tag check; a failing request's blocks return before any K/V
// load (head 0's block reports the verdict), so its rows of `out` stay as they were.
extern "C" __global__ void custody_paged_attention_decode(
    const float* q, const unsigned short* k_cache, const unsigned short* v_cache,
    const CustodyPageRef* tables, const custody_u32* table_off, const custody_u32* table_len,
    const custody_u32* n_ctx, const custody_u64* owners, custody_u32 n_heads,
    custody_u32 n_kv_heads, custody_u32 head_dim, custody_u32 page_size, CustodyTags tags,
    float* out, CustodyVerdict* verdicts) {
    __shared__ custody_u32 first_bad[CUSTODY_ATT_THREADS];
    __shared__ CustodyVerdict verdict;
    __shared__ float scores[CUSTODY_ATT_MAX_CTX];
    __shared__ float red[CUSTODY_ATT_THREADS];
    const custody_u32 head = blockIdx.x, r = blockIdx.y, t = threadIdx.x;
    const CustodyPageRef* table = tables + table_off[r];
    const custody_u32 n = n_ctx[r];
    custody_check_request(table, table_len[r], n, page_size, &tags, owners[r], first_bad,
                          &verdict);
    if (verdict.code != CUSTODY_OK || n > CUSTODY_ATT_MAX_CTX || n == 0) {
        if (head == 0 && t == 0) {
            verdicts[r] = verdict;
            if (verdict.code == CUSTODY_OK) verdicts[r].code = CUSTODY_BLOCK_TABLE_TOO_SHORT;
        }
        return; // uniform: every thread of the block saw the same verdict
    }
    if (head == 0 && t == 0) verdicts[r] = verdict;
    const custody_u32 kvh = head / (n_heads / n_kv_heads);
    const float* qh = q + ((custody_u64)r * n_heads + head) * head_dim;
    const float scale = 1.0f / sqrtf((float)head_dim);
    // Scores, and this thread's running max.
    float m = __uint_as_float(0xff800000u); // -inf (no math.h under NVRTC)
    for (custody_u32 s = t; s < n; s += CUSTODY_ATT_THREADS) {
        const CustodyPageRef pr = table[s / page_size];
        const custody_u64 off =
            (((custody_u64)pr.page * n_kv_heads + kvh) * page_size + s % page_size) * head_dim;
        float dot = 0.0f;
        for (custody_u32 e = 0; e < head_dim; e++) dot += qh[e] * custody_half_to_float(k_cache[off + e]);
        scores[s] = dot * scale;
        m = fmaxf(m, scores[s]);
    }
    red[t] = m;
    __syncthreads();
    for (custody_u32 half = CUSTODY_ATT_THREADS / 2; half > 0; half /= 2) {
        if (t < half) red[t] = fmaxf(red[t], red[t + half]);
        __syncthreads();
    }
    const float mx = red[0];
    __syncthreads();
    float sum = 0.0f;
    for (custody_u32 s = t; s < n; s += CUSTODY_ATT_THREADS) {
        scores[s] = expf(scores[s] - mx);
        sum += scores[s];
    }
    red[t] = sum;
    __syncthreads();
    for (custody_u32 half = CUSTODY_ATT_THREADS / 2; half > 0; half /= 2) {
        if (t < half) red[t] += red[t + half];
        __syncthreads();
    }
    const float inv = 1.0f / red[0];
    float* o = out + ((custody_u64)r * n_heads + head) * head_dim;
    for (custody_u32 e = t; e < head_dim; e += CUSTODY_ATT_THREADS) {
        float acc = 0.0f;
        for (custody_u32 s = 0; s < n; s++) {
            const CustodyPageRef pr = table[s / page_size];
            const custody_u64 off =
                (((custody_u64)pr.page * n_kv_heads + kvh) * page_size + s % page_size) * head_dim;
            acc += scores[s] * custody_half_to_float(v_cache[off + e]);
        }
        o[e] = acc * inv;
    }
}

// The K/V rows of a batch into their slots, as f16 (`custody_float_to_half`, = the CPU's
// conversion): row r goes to slot `slots[r]` of page `pages[r]`; a row whose page is
// CUSTODY_NO_PAGE (its request failed) is skipped. The write's tag check (generation, owner,
// append order) is the host's, made on the pool's authoritative tags before this launch — the
// same `PagePool` check the CPU backend's write makes; the read side's check is in the attention
// kernel above. `k`, `v`: `n × n_kv_heads × head_dim` f32; caches `[page][kv_head][slot][dim]`.
// Grid (n), block (CUSTODY_ATT_THREADS).
extern "C" __global__ void custody_kv_write(const float* k, const float* v,
                                           const custody_u32* pages, const custody_u32* slots,
                                           custody_u32 n_kv_heads, custody_u32 head_dim,
                                           custody_u32 page_size, unsigned short* k_cache,
                                           unsigned short* v_cache) {
    const custody_u32 r = blockIdx.x;
    const custody_u32 page = pages[r];
    if (page == CUSTODY_NO_PAGE) return;
    const custody_u32 kvd = n_kv_heads * head_dim;
    for (custody_u32 i = threadIdx.x; i < kvd; i += CUSTODY_ATT_THREADS) {
        const custody_u32 h = i / head_dim, e = i % head_dim;
        const custody_u64 off =
            (((custody_u64)page * n_kv_heads + h) * page_size + slots[r]) * head_dim + e;
        k_cache[off] = custody_float_to_half(k[(custody_u64)r * kvd + i]);
        v_cache[off] = custody_float_to_half(v[(custody_u64)r * kvd + i]);
    }
}

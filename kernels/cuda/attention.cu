// Paged attention that checks each page's tag before it reads a single slot, and the tag check
// alone. The verdict is the CPU's (`custody_kernels::attention::check_tags`) exactly: the first
// failing page in block-table order, the same checks in the same order, the same reported
// values. A request that fails gets a verdict instead of output: its blocks return before any
// K/V load, and its output rows are not written.
#include "custody.cuh"

// Threads per block of both kernels (the reductions below assume it).
#define CUSTODY_ATT_THREADS 128u
#define CUSTODY_NO_PAGE 0xFFFFFFFFu

// The verdict for page `i` of a block table (0 if it may be read), as `check_tags` orders its
// checks. `i < need` and the table is long enough (checked by the caller).
__device__ CustodyVerdict custody_check_page(const CustodyPageRef* table, custody_u32 i,
                                             custody_u32 n_ctx, custody_u32 page_size,
                                             const CustodyTags* t, const CustodyReader& reader) {
    CustodyVerdict v;
    v.code = CUSTODY_OK;
    v.page = table[i].page;
    v.a = 0;
    v.b = 0;
    const CustodyPageRef ref = CUSTODY_LD(table + i);
    const custody_u32 p = ref.page;
    if (p >= t->n_pages) {
        v.code = CUSTODY_PAGE_OUT_OF_RANGE;
        v.a = t->n_pages;
        return v;
    }
    const custody_u32 found = CUSTODY_LD(t->generation + p);
    if (found != ref.generation) {
        v.code = CUSTODY_STALE_GENERATION;
        v.a = ref.generation;
        v.b = found;
        return v;
    }
    const custody_u64 page_owner = CUSTODY_LD(t->owner + p);
    if (!custody_admits(reader, page_owner)) {
        v.code = CUSTODY_FOREIGN_OWNER;
        v.a = reader.owner;
        v.b = page_owner;
        return v;
    }
    const custody_u32 left = n_ctx - i * page_size;
    const custody_u32 attended = left < page_size ? left : page_size;
    const custody_u32 filled = CUSTODY_LD(t->filled + p);
    if (filled < attended) {
        v.code = CUSTODY_UNWRITTEN_SLOT;
        v.a = filled;
        v.b = found;
        return v;
    }
    const custody_u64 stamp_owner = CUSTODY_LD(t->stamp_owner + p);
    const custody_u32 stamp_generation = CUSTODY_LD(t->stamp_generation + p);
    // The data was last written for the page's owner (the reader, or the namespace whose
    // shared page it is) in this generation.
    if (stamp_owner != page_owner || stamp_generation != found) {
        v.code = CUSTODY_IN_BAND_MISMATCH;
        v.a = stamp_owner;
        v.b = stamp_generation;
        return v;
    }
    return v;
}

// The first failing page index in [lo, hi) of `table` (CUSTODY_NO_PAGE if none): each thread
// checks a share of the pages, the smallest failing index reduced through `red` (shared, one
// entry per thread). Every thread of the block must call it (it has barriers).
__device__ custody_u32 custody_first_bad_in(const CustodyPageRef* table, custody_u32 lo,
                                            custody_u32 hi, custody_u32 n_ctx,
                                            custody_u32 page_size, const CustodyTags* tags,
                                            const CustodyReader& reader, custody_u32* red) {
    const custody_u32 t = threadIdx.x;
    custody_u32 mine = CUSTODY_NO_PAGE;
    for (custody_u32 i = lo + t; i < hi; i += CUSTODY_ATT_THREADS) {
        if (custody_check_page(table, i, n_ctx, page_size, tags, reader).code != CUSTODY_OK) {
            mine = i;
            break;
        }
    }
    red[t] = mine;
    __syncthreads();
    for (custody_u32 half = CUSTODY_ATT_THREADS / 2; half > 0; half /= 2) {
        if (t < half && red[t + half] < red[t]) red[t] = red[t + half];
        __syncthreads();
    }
    const custody_u32 first = red[0];
    __syncthreads();
    return first;
}

// The whole block decides one request's verdict (`custody_first_bad_in` over its pages, a short
// table first); thread 0 writes it to `*verdict` (shared). Every thread must call it.
__device__ void custody_check_request(const CustodyPageRef* table, custody_u32 table_len,
                                      custody_u32 n_ctx, custody_u32 page_size,
                                      const CustodyTags* tags, const CustodyReader& reader,
                                      custody_u32* first_bad, CustodyVerdict* verdict) {
    const custody_u32 need = (n_ctx + page_size - 1) / page_size;
    const custody_u32 first =
        custody_first_bad_in(table, 0, table_len >= need ? need : 0, n_ctx, page_size, tags,
                             reader, first_bad);
    if (threadIdx.x == 0) {
        if (table_len < need) {
            verdict->code = CUSTODY_BLOCK_TABLE_TOO_SHORT;
            verdict->page = 0;
            verdict->a = table_len;
            verdict->b = need;
        } else if (first == CUSTODY_NO_PAGE) {
            verdict->code = CUSTODY_OK;
            verdict->page = 0;
            verdict->a = 0;
            verdict->b = 0;
        } else {
            *verdict = custody_check_page(table, first, n_ctx, page_size, tags, reader);
        }
    }
    __syncthreads();
}

// Tag check alone. Grid (n_req), block (CUSTODY_ATT_THREADS). Request r's block table is
// `tables[table_off[r] .. table_off[r] + table_len[r]]`; it attends `n_ctx[r]` slots as
// `readers[r]`.
extern "C" __global__ void custody_tag_check(const CustodyPageRef* tables,
                                             const custody_u32* table_off,
                                             const custody_u32* table_len,
                                             const custody_u32* n_ctx, const CustodyReader* readers,
                                             custody_u32 page_size, CustodyTags tags,
                                             CustodyVerdict* out) {
    __shared__ custody_u32 first_bad[CUSTODY_ATT_THREADS];
    __shared__ CustodyVerdict verdict;
    const custody_u32 r = blockIdx.x;
    custody_check_request(tables + table_off[r], table_len[r], n_ctx[r], page_size, &tags,
                          custody_load_reader(readers, r), first_bad, &verdict);
    if (threadIdx.x == 0) out[r] = verdict;
}

// The K/V rows of a batch into their slots, as f16 (`custody_float_to_half`, = the CPU's
// conversion): row r goes to slot `slots[r]` of page `pages[r]`; a row whose page is
// CUSTODY_NO_PAGE (its request failed) is skipped. The write's tag check (generation, owner,
// append order) is the host's, made on the pool's authoritative tags before this launch — the
// same `PagePool` check the CPU backend's write makes; the read side's check is in the attention
// kernel above. `k`, `v`: `n × n_kv_heads × head_dim` f32; caches `[page][kv_head][slot][dim]`.
// Grid (n), block (CUSTODY_ATT_THREADS).
__device__ void custody_kv_write_row(const float* k, const float* v, const custody_u32* pages,
                                     const custody_u32* slots, custody_u32 n_kv_heads,
                                     custody_u32 head_dim, custody_u32 page_size,
                                     unsigned short* k_cache, unsigned short* v_cache,
                                     custody_u32 r) {
    const custody_u32 page = CUSTODY_LD(pages + r);
    if (page == CUSTODY_NO_PAGE) return;
    const custody_u32 kvd = n_kv_heads * head_dim, slot = CUSTODY_LD(slots + r);
    for (custody_u32 i = threadIdx.x; i < kvd; i += CUSTODY_ATT_THREADS) {
        const custody_u32 h = i / head_dim, e = i % head_dim;
        const custody_u64 off =
            (((custody_u64)page * n_kv_heads + h) * page_size + slot) * head_dim + e;
        CUSTODY_ST(k_cache + off, custody_float_to_half(CUSTODY_LD(k + (custody_u64)r * kvd + i)));
        CUSTODY_ST(v_cache + off, custody_float_to_half(CUSTODY_LD(v + (custody_u64)r * kvd + i)));
    }
}

extern "C" __global__ void custody_kv_write(const float* k, const float* v,
                                           const custody_u32* pages, const custody_u32* slots,
                                           custody_u32 n_kv_heads, custody_u32 head_dim,
                                           custody_u32 page_size, unsigned short* k_cache,
                                           unsigned short* v_cache) {
    custody_kv_write_row(k, v, pages, slots, n_kv_heads, head_dim, page_size, k_cache, v_cache,
                         blockIdx.x);
}

// A row's RoPE on its Q and K heads, then its K and V stored in the KV cache
// (`custody_kv_write_row`): `custody_rope` twice and `custody_kv_write` in one launch, the same
// arithmetic. Grid (rows), block (128).
extern "C" __global__ void custody_rope_kv_write(
    float* q, float* k, const float* v, const custody_u32* positions, custody_u32 n_heads,
    custody_u32 n_kv_heads, custody_u32 head_dim, custody_u32 n_rot, float freq_base,
    const float* freq_factors, custody_u32 neox, const custody_u32* pages,
    const custody_u32* slots, custody_u32 page_size, unsigned short* k_cache,
    unsigned short* v_cache) {
    const custody_u32 r = blockIdx.x;
    const float pos = (float)CUSTODY_LD(positions + r);
    custody_rope_row(q + (custody_u64)r * n_heads * head_dim, pos, n_heads, head_dim, n_rot,
                     freq_base, freq_factors, neox);
    custody_rope_row(k + (custody_u64)r * n_kv_heads * head_dim, pos, n_kv_heads, head_dim, n_rot,
                     freq_base, freq_factors, neox);
    __syncthreads();  // the row's rotated K, written by every thread, before it is stored
    custody_kv_write_row(k, v, pages, slots, n_kv_heads, head_dim, page_size, k_cache, v_cache, r);
}

// ---- Paged flash-decoding: split-K over a row's pages, the tag check inside each split.
//
// `custody_flash_decode` — grid (n_kv_heads, n_rows, n_splits), block (CUSTODY_ATT_THREADS):
// CTA (g, r, s) attends row r's query heads of KV head g (the G = n_heads / n_kv_heads heads
// that share it: one K/V load serves all of them) over pages [s·pps, (s+1)·pps) of the row's
// block table (pps = pages per split). Before its first K/V load it checks the tags of exactly
// those pages (`custody_check_page`, the CPU's checks in the CPU's order) and publishes the
// first failing index of its range in `bad[(r · n_kv_heads + g) · n_splits + s]`
// (CUSTODY_NO_PAGE if none); a failing CTA reads no slot. A passing CTA runs an online softmax
// over its slots in tiles of CUSTODY_FD_TILE and writes, per query head, its unnormalised
// output, running max and sum to `partial` (`[slot][head][s][head_dim + 2]`). The last of a
// (row, group)'s splits to finish merges them in the same launch (`custody_flash_arrive`,
// counting arrivals in `arrivals[slot · n_kv_heads + g]`, zero between launches): it decides the
// row's verdict from the splits' published indices (the smallest, re-checked for its values; a
// short table first) and writes the group's heads of `out` only when the row passes — one
// launch per layer's attention, not two. Grid row `slot` serves the step's row `rows[slot]`
// (all rows in order when `rows` is null): a step whose prompts go to the prefill kernel sends
// only its other rows here. No context cap: splits × pps covers any table. With `xq` and `xs`
// not null (head_dim a multiple of 32, n_heads · head_dim of 256), the merge also stores each
// output row quantized for the O product's dp4a GEMV (`custody_q8_block`).
//
// K and V are read in 16-byte vectors (8 halves): V = head_dim / 8 lanes per slot, 32 / V slots
// per warp instruction, a slot's row contiguous in the page (`[page][kv_head][slot][dim]`).
// head_dim must be a power of two in [8, 256] and G ≤ CUSTODY_FD_MAX_GROUP (the host refuses
// other shapes by name).
#define CUSTODY_FD_TILE 64u
#define CUSTODY_FD_MAX_GROUP 8u
#define CUSTODY_FD_MAX_DIM 256u
#define CUSTODY_FD_WARPS (CUSTODY_ATT_THREADS / 32u)

// Eight halves of a 16-byte vector as floats.
__device__ __forceinline__ void custody_unpack8(uint4 v, float* f) {
    const custody_u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (custody_u32 i = 0; i < 4; i++) {
        f[2 * i] = custody_half_to_float((unsigned short)(w[i] & 0xffffu));
        f[2 * i + 1] = custody_half_to_float((unsigned short)(w[i] >> 16));
    }
}


// The verdict of row `r` from the first failing page indices its splits published (`bad`,
// `n_splits` of them: one group's, all checking the same pages), re-checked for the reported
// values; a short table first. Every thread of the block calls it and gets the verdict.
__device__ CustodyVerdict custody_row_verdict(const CustodyPageRef* table, custody_u32 len,
                                              custody_u32 n, custody_u32 page_size,
                                              const CustodyTags* tags, const CustodyReader& reader,
                                              const custody_u32* bad, custody_u32 n_splits,
                                              custody_u32* red) {
    const custody_u32 t = threadIdx.x;
    custody_u32 mine = CUSTODY_NO_PAGE;
    for (custody_u32 s = t; s < n_splits; s += CUSTODY_ATT_THREADS) {
        const custody_u32 b = CUSTODY_LD_CG(bad + s);
        if (b < mine) mine = b;
    }
    red[t] = mine;
    __syncthreads();
    for (custody_u32 half = CUSTODY_ATT_THREADS / 2; half > 0; half /= 2) {
        if (t < half && red[t + half] < red[t]) red[t] = red[t + half];
        __syncthreads();
    }
    const custody_u32 first = red[0];
    __syncthreads();  // `red` is reused by the caller
    const custody_u32 need = (n + page_size - 1) / page_size;
    CustodyVerdict v;
    v.code = CUSTODY_OK;
    v.page = 0;
    v.a = 0;
    v.b = 0;
    if (len < need || n == 0) {
        v.code = CUSTODY_BLOCK_TABLE_TOO_SHORT;
        v.a = len;
        v.b = need;
    } else if (first != CUSTODY_NO_PAGE) {
        v = custody_check_page(table, first, n, page_size, tags, reader);
    }
    return v;
}

// Head `head`'s output of row `r` from its `n_splits` partials (`part`, stride head_dim + 2):
// Σ_s acc_s · e^(m_s − M) / Σ_s l_s · e^(m_s − M). The partials were written by other CTAs of
// this launch (or an earlier one): read through L2 (`CUSTODY_LD_CG`), never a stale L1 line.
// With `xq` not null (head_dim a multiple of 32) the output is also stored quantized for the
// dp4a GEMV (`custody_q8_block`: each iteration's warp holds one block of 32) as elements
// `k0`.. of row `r` of `cols`.
__device__ void custody_merge_head(const float* part, custody_u32 n_splits, custody_u32 head_dim,
                                   float* o, unsigned char* xq, float* xs, custody_u32 r,
                                   custody_u32 cols, custody_u32 k0) {
    const custody_u32 stride = head_dim + 2;
    float mx = __uint_as_float(0xff800000u);
    for (custody_u32 s = 0; s < n_splits; s++) mx = fmaxf(mx, CUSTODY_LD_CG(part + s * stride + head_dim));
    float l = 0.0f;
    for (custody_u32 s = 0; s < n_splits; s++) {
        const float m = CUSTODY_LD_CG(part + s * stride + head_dim);
        if (m != __uint_as_float(0xff800000u)) l += CUSTODY_LD_CG(part + s * stride + head_dim + 1) * expf(m - mx);
    }
    for (custody_u32 e = threadIdx.x; e < head_dim; e += CUSTODY_ATT_THREADS) {
        float acc = 0.0f;
        for (custody_u32 s = 0; s < n_splits; s++) {
            const float m = CUSTODY_LD_CG(part + s * stride + head_dim);
            if (m != __uint_as_float(0xff800000u)) acc += CUSTODY_LD_CG(part + s * stride + e) * expf(m - mx);
        }
        CUSTODY_ST(o + e, acc / l);
        // Uniform per warp: whole warps iterate when head_dim is a multiple of 32.
        if (xq) custody_q8_block(acc / l, r, cols, k0 + e - threadIdx.x % 32, xq, xs);
    }
}

// A flash-decoding CTA's last act: count itself in (row r, KV head g)'s arrivals; the last of the
// `n_splits` to arrive merges the group — the row's verdict (KV head 0's group reports it) and,
// for a passing row, the outputs of the group's query heads — and resets the count for the next
// launch (a graph replays this one). `slot`: the row's place in the launch (its arrivals,
// indices and partials); `r`: the step's row (its output and verdict). Every thread calls it.
__device__ void custody_flash_arrive(const CustodyPageRef* table, custody_u32 len, custody_u32 n,
                                     const CustodyReader& reader, custody_u32 r, custody_u32 slot,
                                     custody_u32 g,
                                     custody_u32 n_heads, custody_u32 n_kv_heads,
                                     custody_u32 head_dim, custody_u32 page_size,
                                     const CustodyTags* tags, custody_u32 n_splits,
                                     const float* partial, const custody_u32* bad,
                                     custody_u32* arrivals, float* out, CustodyVerdict* verdicts,
                                     unsigned char* xq, float* xs, custody_u32* red) {
    __shared__ custody_u32 last;
    __threadfence();  // this CTA's partial and index are visible before it counts itself
    if (threadIdx.x == 0) {
        custody_u32* count = arrivals + (custody_u64)slot * n_kv_heads + g;
        last = atomicAdd(count, 1u) == n_splits - 1;
        if (last) *count = 0;  // every split has arrived: no more adds this launch
    }
    __syncthreads();
    if (!last) return;  // uniform
    __threadfence();
    const CustodyVerdict v =
        custody_row_verdict(table, len, n, page_size, tags, reader,
                            bad + ((custody_u64)slot * n_kv_heads + g) * n_splits, n_splits, red);
    if (g == 0 && threadIdx.x == 0) CUSTODY_ST(verdicts + r, v);
    if (v.code != CUSTODY_OK) return;  // uniform: a failing row's output is never written
    const custody_u32 group = n_heads / n_kv_heads;
    for (custody_u32 i = 0; i < group; i++) {
        const custody_u32 head = g * group + i;
        custody_merge_head(
            partial + ((custody_u64)slot * n_heads + head) * n_splits * (head_dim + 2), n_splits,
            head_dim, out + ((custody_u64)r * n_heads + head) * head_dim, xq, xs, r,
            n_heads * head_dim, head * head_dim);
    }
}

extern "C" __global__ void custody_flash_decode(
    const float* q, const unsigned short* k_cache, const unsigned short* v_cache,
    const CustodyPageRef* tables, const custody_u32* table_off, const custody_u32* table_len,
    const custody_u32* n_ctx, const CustodyReader* readers, custody_u32 n_heads,
    custody_u32 n_kv_heads, custody_u32 head_dim, custody_u32 page_size, CustodyTags tags,
    custody_u32 pages_per_split, float* partial, custody_u32* bad, custody_u32* arrivals,
    float* out, CustodyVerdict* verdicts, const custody_u32* rows, unsigned char* xq, float* xs) {
    __shared__ custody_u32 red[CUSTODY_ATT_THREADS];
    __shared__ float qs[CUSTODY_FD_MAX_GROUP * CUSTODY_FD_MAX_DIM];
    __shared__ float p[CUSTODY_FD_MAX_GROUP * CUSTODY_FD_TILE];
    __shared__ float run_m[CUSTODY_FD_MAX_GROUP], run_l[CUSTODY_FD_MAX_GROUP];
    __shared__ float alpha[CUSTODY_FD_MAX_GROUP];
    __shared__ float accs[CUSTODY_FD_WARPS * CUSTODY_FD_MAX_GROUP * CUSTODY_FD_MAX_DIM];
    const custody_u32 g = blockIdx.x, slot = blockIdx.y, s = blockIdx.z, t = threadIdx.x;
    // The step's row this CTA serves: `rows[slot]`, or the slot itself when `rows` is null.
    const custody_u32 r = rows ? CUSTODY_LD(rows + slot) : slot;
    const custody_u32 warp = t / 32, lane = t % 32;
    const custody_u32 n_splits = gridDim.z, group = n_heads / n_kv_heads;
    const CustodyPageRef* table = tables + CUSTODY_LD(table_off + r);
    const custody_u32 n = CUSTODY_LD(n_ctx + r);
    const custody_u32 need = (n + page_size - 1) / page_size;
    const custody_u32 lo = s * pages_per_split;
    const custody_u32 hi = lo + pages_per_split < need ? lo + pages_per_split : need;
    const custody_u32 len = CUSTODY_LD(table_len + r);
    const CustodyReader reader = custody_load_reader(readers, r);
    // A short table is the merge's verdict; no split reads a page of it.
    const bool readable = len >= need && lo < hi;
#ifdef CUSTODY_BENCH_NO_TAG_CHECK
    // The check's cost, measured: only `custody gpu-check speed` compiles this (a second module
    // of its own, `CudaDevice::open_without_tag_check`); the engine's module never defines it.
    const custody_u32 first = CUSTODY_NO_PAGE;
    (void)red;
#else
    const custody_u32 first = readable ? custody_first_bad_in(table, lo, hi, n, page_size, &tags,
                                                              reader, red)
                                       : CUSTODY_NO_PAGE;
#endif
    if (t == 0) CUSTODY_ST(bad + ((custody_u64)slot * n_kv_heads + g) * n_splits + s, first);
    const custody_u32 stride = head_dim + 2;
    float* part = partial + (((custody_u64)slot * n_heads + g * group) * n_splits + s) * stride;
    if (!readable || first != CUSTODY_NO_PAGE) {
        // Nothing read: an empty partial (max −inf, sum 0) the merge weighs as nothing.
        for (custody_u32 i = t; i < group; i += CUSTODY_ATT_THREADS) {
            CUSTODY_ST(part + (custody_u64)i * n_splits * stride + head_dim,
                       __uint_as_float(0xff800000u));
            CUSTODY_ST(part + (custody_u64)i * n_splits * stride + head_dim + 1, 0.0f);
        }
        // Uniform: every thread saw the same `readable` and `first`.
        custody_flash_arrive(table, len, n, reader, r, slot, g, n_heads, n_kv_heads, head_dim, page_size,
                             &tags, n_splits, partial, bad, arrivals, out, verdicts, xq, xs, red);
        return;
    }
    // The group's queries, scaled, in shared memory.
    const float scale = 1.0f / sqrtf((float)head_dim);
    const float* qg = q + ((custody_u64)r * n_heads + g * group) * head_dim;
    for (custody_u32 i = t; i < group * head_dim; i += CUSTODY_ATT_THREADS)
        qs[i] = CUSTODY_LD(qg + i) * scale;
    if (t < group) {
        run_m[t] = __uint_as_float(0xff800000u);
        run_l[t] = 0.0f;
    }
    const custody_u32 vecs = head_dim / 8, per_warp = 32 / vecs;
    const custody_u32 slot_in_step = warp * per_warp + lane / vecs, sub = lane % vecs;
    const custody_u32 kv_row = head_dim;  // halves per slot row
    float acc[CUSTODY_FD_MAX_GROUP][8];
#pragma unroll
    for (custody_u32 h = 0; h < CUSTODY_FD_MAX_GROUP; h++)
#pragma unroll
        for (custody_u32 e = 0; e < 8; e++) acc[h][e] = 0.0f;
    const custody_u32 first_slot = lo * page_size;
    const custody_u32 end_slot = hi * page_size < n ? hi * page_size : n;
    __syncthreads();
    for (custody_u32 tile = first_slot; tile < end_slot; tile += CUSTODY_FD_TILE) {
        // Scores of the tile's slots for every head of the group.
        for (custody_u32 j = slot_in_step; j < CUSTODY_FD_TILE; j += CUSTODY_FD_WARPS * per_warp) {
            const custody_u32 slot = tile + j;
            float dot[CUSTODY_FD_MAX_GROUP];
#pragma unroll
            for (custody_u32 h = 0; h < CUSTODY_FD_MAX_GROUP; h++) dot[h] = 0.0f;
            if (slot < end_slot) {
                const CustodyPageRef pr = CUSTODY_LD(table + slot / page_size);
                const custody_u64 off =
                    (((custody_u64)pr.page * n_kv_heads + g) * page_size + slot % page_size) *
                        kv_row + 8 * sub;
                float k[8];
                custody_unpack8(CUSTODY_LD((const uint4*)(k_cache + off)), k);
#pragma unroll
                for (custody_u32 h = 0; h < CUSTODY_FD_MAX_GROUP; h++) {
                    if (h < group) {
                        const float* qh = qs + h * head_dim + 8 * sub;
#pragma unroll
                        for (custody_u32 e = 0; e < 8; e++) dot[h] += qh[e] * k[e];
                    }
                }
            }
#pragma unroll
            for (custody_u32 h = 0; h < CUSTODY_FD_MAX_GROUP; h++) {
                for (custody_u32 m = vecs / 2; m > 0; m /= 2)
                    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], m);
                if (sub == 0 && h < group)
                    p[h * CUSTODY_FD_TILE + j] =
                        slot < end_slot ? dot[h] : __uint_as_float(0xff800000u);
            }
        }
        __syncthreads();
        // Online softmax per head: warp w serves heads w, w + 4.
        for (custody_u32 h = warp; h < group; h += CUSTODY_FD_WARPS) {
            float mx = __uint_as_float(0xff800000u);
            for (custody_u32 j = lane; j < CUSTODY_FD_TILE; j += 32) mx = fmaxf(mx, p[h * CUSTODY_FD_TILE + j]);
            for (custody_u32 m = 16; m > 0; m /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
            const float m_new = fmaxf(run_m[h], mx);
            float sum = 0.0f;
            for (custody_u32 j = lane; j < CUSTODY_FD_TILE; j += 32) {
                const float e = expf(p[h * CUSTODY_FD_TILE + j] - m_new);
                p[h * CUSTODY_FD_TILE + j] = e;
                sum += e;
            }
            for (custody_u32 m = 16; m > 0; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
            __syncwarp();  // every lane has read run_m before lane 0 changes it
            if (lane == 0) {
                const float a = expf(run_m[h] - m_new);
                alpha[h] = a;
                run_l[h] = run_l[h] * a + sum;
                run_m[h] = m_new;
            }
        }
        __syncthreads();
        // V: rescale, then add this tile's weighted rows.
#pragma unroll
        for (custody_u32 h = 0; h < CUSTODY_FD_MAX_GROUP; h++) {
            if (h < group) {
                const float a = alpha[h];
#pragma unroll
                for (custody_u32 e = 0; e < 8; e++) acc[h][e] *= a;
            }
        }
        for (custody_u32 j = slot_in_step; j < CUSTODY_FD_TILE; j += CUSTODY_FD_WARPS * per_warp) {
            const custody_u32 slot = tile + j;
            if (slot >= end_slot) continue;
            const CustodyPageRef pr = CUSTODY_LD(table + slot / page_size);
            const custody_u64 off =
                (((custody_u64)pr.page * n_kv_heads + g) * page_size + slot % page_size) * kv_row +
                8 * sub;
            float v[8];
            custody_unpack8(CUSTODY_LD((const uint4*)(v_cache + off)), v);
#pragma unroll
            for (custody_u32 h = 0; h < CUSTODY_FD_MAX_GROUP; h++) {
                if (h < group) {
                    const float w = p[h * CUSTODY_FD_TILE + j];
#pragma unroll
                    for (custody_u32 e = 0; e < 8; e++) acc[h][e] += w * v[e];
                }
            }
        }
        __syncthreads();  // p is rewritten by the next tile
    }
    // Sum the lanes that hold the same dimensions (other slots of the step): within the warp by
    // shuffles, across warps through shared memory.
#pragma unroll
    for (custody_u32 h = 0; h < CUSTODY_FD_MAX_GROUP; h++)
#pragma unroll
        for (custody_u32 e = 0; e < 8; e++)
            for (custody_u32 m = vecs; m < 32; m *= 2)
                acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], m);
    if (lane < vecs) {
#pragma unroll
        for (custody_u32 h = 0; h < CUSTODY_FD_MAX_GROUP; h++)
            if (h < group)
#pragma unroll
                for (custody_u32 e = 0; e < 8; e++)
                    accs[(warp * CUSTODY_FD_MAX_GROUP + h) * CUSTODY_FD_MAX_DIM + 8 * sub + e] = acc[h][e];
    }
    __syncthreads();
    for (custody_u32 i = t; i < group * head_dim; i += CUSTODY_ATT_THREADS) {
        const custody_u32 h = i / head_dim, e = i % head_dim;
        float sum = 0.0f;
        for (custody_u32 w = 0; w < CUSTODY_FD_WARPS; w++)
            sum += accs[(w * CUSTODY_FD_MAX_GROUP + h) * CUSTODY_FD_MAX_DIM + e];
        CUSTODY_ST(part + (custody_u64)h * n_splits * stride + e, sum);
    }
    if (t < group) {
        CUSTODY_ST(part + (custody_u64)t * n_splits * stride + head_dim, run_m[t]);
        CUSTODY_ST(part + (custody_u64)t * n_splits * stride + head_dim + 1, run_l[t]);
    }
    custody_flash_arrive(table, len, n, reader, r, slot, g, n_heads, n_kv_heads, head_dim, page_size,
                         &tags, n_splits, partial, bad, arrivals, out, verdicts, xq, xs, red);
}

// ---- Prefill attention on tensor cores: flash attention over a prompt's rows, the tag check
// inside.
//
// `custody_flash_prefill` — grid (n_heads, n_tiles), block (CUSTODY_ATT_THREADS: 4 warps): CTA
// (h, i) attends query head h for tile i, rows tiles[2i] .. + tiles[2i + 1] (at most
// CUSTODY_FP_ROWS consecutive rows of one segment: one block table, positions ascending); warp w
// serves rows 16w .. 16w + 15 of it. Before its first K/V load the CTA checks the pages its last
// row attends (the most any row does: `custody_first_bad_in`), and query head 0's CTA writes
// each row's verdict from the first page failing *that row's* check (a short table first, the
// page re-checked for its values, as flash decoding's merge) — a row's pages below its last one
// are checked alike for every row (whole pages), so only its last page needs its own check. A failing row (or one whose table is short) is
// masked out entirely; the CTA reads only slots below the longest passing row's count, every
// one of them covered by that row's check. It walks the context in tiles of CUSTODY_FP_KT
// slots: K and V staged in shared memory by 16-byte loads (a slot's row is contiguous in its
// page), S = Q·Kᵀ and O += P·V as m16n8k16 MMAs (`custody_mma_m16n8k16`: f16 inputs, f32
// accumulation — the flash-attention-2 register layout, S's accumulators reused as P's A
// fragments), the causal mask per row, the online softmax in registers; it writes each passing
// row's output (one split: nothing to merge).
// head_dim a multiple of 16 up to CUSTODY_FP_MAX_DIM (the host sends other shapes to flash
// decoding).
#define CUSTODY_FP_ROWS 64u
#define CUSTODY_FP_KT 32u
#define CUSTODY_FP_MAX_DIM 128u

// Two floats as an f16x2 register (the lower-indexed element in the low half).
__device__ __forceinline__ custody_u32 custody_pack_half2(float lo, float hi) {
    return (custody_u32)custody_float_to_half(lo) | ((custody_u32)custody_float_to_half(hi) << 16);
}

// Two adjacent halves of shared memory as one f16x2 register.
__device__ __forceinline__ custody_u32 custody_half2_at(const unsigned short* p) {
    return (custody_u32)p[0] | ((custody_u32)p[1] << 16);
}

// The first page failing the check of a row attending `n` slots (CUSTODY_NO_PAGE if none),
// given `first`, the first failing page of the check over the tile's last row (`n_max` ≥ n).
__device__ custody_u32 custody_row_first_bad(const CustodyPageRef* table, custody_u32 first,
                                             custody_u32 n, custody_u32 page_size,
                                             const CustodyTags* tags, const CustodyReader& reader) {
    const custody_u32 need = (n + page_size - 1) / page_size;
    if (first == CUSTODY_NO_PAGE) return CUSTODY_NO_PAGE;  // every page passed with more slots
    if (first + 1 < need) return first;                     // a whole page: checked alike
    return custody_check_page(table, need - 1, n, page_size, tags, reader).code == CUSTODY_OK
               ? CUSTODY_NO_PAGE
               : need - 1;
}

extern "C" __global__ void custody_flash_prefill(
    const float* q, const unsigned short* k_cache, const unsigned short* v_cache,
    const CustodyPageRef* tables, const custody_u32* table_off, const custody_u32* table_len,
    const custody_u32* n_ctx, const CustodyReader* readers, custody_u32 n_heads,
    custody_u32 n_kv_heads, custody_u32 head_dim, custody_u32 page_size, CustodyTags tags,
    const custody_u32* tiles, float* out, CustodyVerdict* verdicts) {
    __shared__ custody_u32 red[CUSTODY_ATT_THREADS];
    __shared__ custody_u32 row_n[CUSTODY_FP_ROWS];
    // f16 tiles, declared as 16-byte vectors for the staging stores' alignment.
    __shared__ uint4 qs4[CUSTODY_FP_ROWS * CUSTODY_FP_MAX_DIM / 8];
    __shared__ uint4 ks4[CUSTODY_FP_KT * CUSTODY_FP_MAX_DIM / 8];
    __shared__ uint4 vs4[CUSTODY_FP_KT * CUSTODY_FP_MAX_DIM / 8];
    unsigned short* qs = (unsigned short*)qs4;
    unsigned short* ks = (unsigned short*)ks4;
    unsigned short* vs = (unsigned short*)vs4;
    const custody_u32 h = blockIdx.x, t = threadIdx.x, warp = t / 32, lane = t % 32;
    const custody_u32 g = lane / 4, q4 = lane % 4;
    const custody_u32 r0 = CUSTODY_LD(tiles + 2 * blockIdx.y);
    const custody_u32 nr = CUSTODY_LD(tiles + 2 * blockIdx.y + 1);
    const custody_u32 kvh = h / (n_heads / n_kv_heads);
    const CustodyPageRef* table = tables + CUSTODY_LD(table_off + r0);
    const custody_u32 len = CUSTODY_LD(table_len + r0);
    const CustodyReader reader = custody_load_reader(readers, r0);
    const custody_u32 n_max = CUSTODY_LD(n_ctx + r0 + nr - 1);
    const custody_u32 need_max = (n_max + page_size - 1) / page_size;
    const bool short_table = len < need_max;
#ifdef CUSTODY_BENCH_NO_TAG_CHECK
    const custody_u32 first = CUSTODY_NO_PAGE;
    (void)red;
#else
    const custody_u32 first = custody_first_bad_in(table, 0, short_table ? len : need_max, n_max,
                                                   page_size, &tags, reader, red);
#endif
    // Each row's verdict: the slots it attends if it passes, 0 if it fails (then no slot is
    // read for it, and the merge reports it without reading its partial).
    for (custody_u32 i = t; i < CUSTODY_FP_ROWS; i += CUSTODY_ATT_THREADS) {
        custody_u32 attends = 0;
        if (i < nr) {
            const custody_u32 n = CUSTODY_LD(n_ctx + r0 + i);
            const custody_u32 need = (n + page_size - 1) / page_size;
            const bool short_row = need > len || n == 0;
            const custody_u32 b =
                short_row ? CUSTODY_NO_PAGE
                          : custody_row_first_bad(table, first, n, page_size, &tags, reader);
            if (h == 0) {
                // The row's verdict, as the merge decides it: a short table first, else the
                // first failing page re-checked for its values.
                CustodyVerdict v;
                v.code = CUSTODY_OK;
                v.page = 0;
                v.a = 0;
                v.b = 0;
                if (short_row) {
                    v.code = CUSTODY_BLOCK_TABLE_TOO_SHORT;
                    v.a = len;
                    v.b = need;
                } else if (b != CUSTODY_NO_PAGE) {
                    v = custody_check_page(table, b, n, page_size, &tags, reader);
                }
                CUSTODY_ST(verdicts + r0 + i, v);
            }
            attends = !short_row && b == CUSTODY_NO_PAGE ? n : 0;
        }
        row_n[i] = attends;
    }
    __syncthreads();
    // The slots the CTA reads: below the longest passing row's count — each of them checked
    // for that row (its pages before its last one whole, its last one up to its count).
    custody_u32 n_hi = 0;
    for (custody_u32 i = 0; i < CUSTODY_FP_ROWS; i++) n_hi = row_n[i] > n_hi ? row_n[i] : n_hi;
    if (n_hi == 0) return;  // uniform: every row failed, nothing is read
    // The tile's queries, scaled, as f16 (rows past `nr`: zero).
    const float scale = 1.0f / sqrtf((float)head_dim);
    for (custody_u32 i = t; i < CUSTODY_FP_ROWS * head_dim; i += CUSTODY_ATT_THREADS) {
        const custody_u32 row = i / head_dim, e = i % head_dim;
        const float x =
            row < nr ? CUSTODY_LD(q + ((custody_u64)(r0 + row) * n_heads + h) * head_dim + e) * scale
                     : 0.0f;
        qs[i] = custody_float_to_half(x);
    }
    // This lane's two rows (g and g + 8 of the warp's 16) and how many slots each attends
    // (0 past the tile: never unmasked).
    const custody_u32 ra = warp * 16 + g, rb = ra + 8;
    const custody_u32 na = row_n[ra], nb = row_n[rb];
    const float neg_inf = __uint_as_float(0xff800000u);
    float o[CUSTODY_FP_MAX_DIM / 8][4];
#pragma unroll
    for (custody_u32 d = 0; d < CUSTODY_FP_MAX_DIM / 8; d++)
#pragma unroll
        for (custody_u32 i = 0; i < 4; i++) o[d][i] = 0.0f;
    float m_a = neg_inf, m_b = neg_inf, l_a = 0.0f, l_b = 0.0f;
    const custody_u32 vecs = head_dim / 8;
    for (custody_u32 tile = 0; tile < n_hi; tile += CUSTODY_FP_KT) {
        __syncthreads();  // the queries are staged; the previous tile's K and V are read
        for (custody_u32 i = t; i < CUSTODY_FP_KT * vecs; i += CUSTODY_ATT_THREADS) {
            const custody_u32 j = i / vecs, c = i % vecs, slot = tile + j;
            uint4 kv = {0u, 0u, 0u, 0u}, vv = {0u, 0u, 0u, 0u};
            if (slot < n_hi) {
                const CustodyPageRef pr = CUSTODY_LD(table + slot / page_size);
                const custody_u64 off =
                    (((custody_u64)pr.page * n_kv_heads + kvh) * page_size + slot % page_size) *
                        head_dim + 8 * c;
                kv = CUSTODY_LD((const uint4*)(k_cache + off));
                vv = CUSTODY_LD((const uint4*)(v_cache + off));
            }
            *(uint4*)(ks + j * head_dim + 8 * c) = kv;
            *(uint4*)(vs + j * head_dim + 8 * c) = vv;
        }
        __syncthreads();
        // S = Q·Kᵀ over the tile's 32 slots: four 16 × 8 blocks.
        float s[CUSTODY_FP_KT / 8][4];
#pragma unroll
        for (custody_u32 nb8 = 0; nb8 < CUSTODY_FP_KT / 8; nb8++)
#pragma unroll
            for (custody_u32 i = 0; i < 4; i++) s[nb8][i] = 0.0f;
        for (custody_u32 kb = 0; kb < head_dim / 16; kb++) {
            const custody_u32 col = kb * 16 + 2 * q4;
            const custody_u32 a[4] = {
                custody_half2_at(qs + ra * head_dim + col), custody_half2_at(qs + rb * head_dim + col),
                custody_half2_at(qs + ra * head_dim + col + 8),
                custody_half2_at(qs + rb * head_dim + col + 8)};
#pragma unroll
            for (custody_u32 nb8 = 0; nb8 < CUSTODY_FP_KT / 8; nb8++) {
                const unsigned short* krow = ks + (nb8 * 8 + g) * head_dim + col;
                const custody_u32 b[2] = {custody_half2_at(krow), custody_half2_at(krow + 8)};
                custody_mma_m16n8k16(s[nb8], a, b, s[nb8]);
            }
        }
        // The causal mask, then the online softmax of rows ra (elements 0, 1) and rb (2, 3);
        // a row's four lanes (q4 = 0..3) share it through shuffles.
        float mx_a = neg_inf, mx_b = neg_inf;
#pragma unroll
        for (custody_u32 nb8 = 0; nb8 < CUSTODY_FP_KT / 8; nb8++)
#pragma unroll
            for (custody_u32 i = 0; i < 4; i++) {
                const custody_u32 slot = tile + nb8 * 8 + 2 * q4 + (i & 1u);
                if (slot >= (i < 2 ? na : nb)) s[nb8][i] = neg_inf;
                if (i < 2) mx_a = fmaxf(mx_a, s[nb8][i]);
                else mx_b = fmaxf(mx_b, s[nb8][i]);
            }
        for (custody_u32 m = 1; m < 4; m *= 2) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, m));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, m));
        }
        const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
        // A row with no slot unmasked yet keeps max −inf: its exponentials are taken against 0
        // (all 0), never −inf − −inf.
        const float base_a = new_a == neg_inf ? 0.0f : new_a;
        const float base_b = new_b == neg_inf ? 0.0f : new_b;
        float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
        for (custody_u32 nb8 = 0; nb8 < CUSTODY_FP_KT / 8; nb8++)
#pragma unroll
            for (custody_u32 i = 0; i < 4; i++) {
                const float e = expf(s[nb8][i] - (i < 2 ? base_a : base_b));
                s[nb8][i] = e;
                if (i < 2) sum_a += e;
                else sum_b += e;
            }
        for (custody_u32 m = 1; m < 4; m *= 2) {
            sum_a += __shfl_xor_sync(0xffffffffu, sum_a, m);
            sum_b += __shfl_xor_sync(0xffffffffu, sum_b, m);
        }
        const float alpha_a = expf(m_a - base_a), alpha_b = expf(m_b - base_b);
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
        m_a = new_a;
        m_b = new_b;
#pragma unroll
        for (custody_u32 d = 0; d < CUSTODY_FP_MAX_DIM / 8; d++) {
            o[d][0] *= alpha_a;
            o[d][1] *= alpha_a;
            o[d][2] *= alpha_b;
            o[d][3] *= alpha_b;
        }
        // O += P·V: two steps of 16 slots; P's A fragments are S's accumulators, as f16.
#pragma unroll
        for (custody_u32 k16 = 0; k16 < CUSTODY_FP_KT / 16; k16++) {
            const custody_u32 a[4] = {custody_pack_half2(s[2 * k16][0], s[2 * k16][1]),
                                      custody_pack_half2(s[2 * k16][2], s[2 * k16][3]),
                                      custody_pack_half2(s[2 * k16 + 1][0], s[2 * k16 + 1][1]),
                                      custody_pack_half2(s[2 * k16 + 1][2], s[2 * k16 + 1][3])};
            const unsigned short* v0 = vs + (k16 * 16 + 2 * q4) * head_dim + g;
#pragma unroll
            for (custody_u32 d = 0; d < CUSTODY_FP_MAX_DIM / 8; d++) {
                if (d < head_dim / 8) {
                    const unsigned short* vp = v0 + d * 8;
                    const custody_u32 b[2] = {
                        (custody_u32)vp[0] | ((custody_u32)vp[head_dim] << 16),
                        (custody_u32)vp[8 * head_dim] | ((custody_u32)vp[9 * head_dim] << 16)};
                    custody_mma_m16n8k16(o[d], a, b, o[d]);
                }
            }
        }
    }
    // Each passing row's output (its one split is the whole context: no merge).
    const float inv_a = na > 0 ? 1.0f / l_a : 0.0f, inv_b = nb > 0 ? 1.0f / l_b : 0.0f;
    float* out_a = out + ((custody_u64)(r0 + ra) * n_heads + h) * head_dim;
    float* out_b = out + ((custody_u64)(r0 + rb) * n_heads + h) * head_dim;
#pragma unroll
    for (custody_u32 d = 0; d < CUSTODY_FP_MAX_DIM / 8; d++) {
        if (d < head_dim / 8) {
            const custody_u32 e = d * 8 + 2 * q4;
            if (na > 0) {
                CUSTODY_ST(out_a + e, o[d][0] * inv_a);
                CUSTODY_ST(out_a + e + 1, o[d][1] * inv_a);
            }
            if (nb > 0) {
                CUSTODY_ST(out_b + e, o[d][2] * inv_b);
                CUSTODY_ST(out_b + e + 1, o[d][3] * inv_b);
            }
        }
    }
}

// The device's copy of the pool's tags brought up to date: entry i of the step's changes
// (`custody_engine`'s `PagePool::take_tag_changes`, packed by the host) written to page
// `pages[i]` — generation, owner, in-band stamp, and its `filled` in every layer
// (`filled[layer · n_pages + page]`). The host pool stays the only authority that changes a
// tag; this kernel only copies its values. `packed`: the count n (u64), then owner[n],
// stamp_owner[n] (u64), pages[n], generation[n], stamp_generation[n], filled[n_layers][n] (u32).
// The count is read from memory, not passed, and the grid is fixed (any, each block striding
// over the entries): a step's launch is the same whatever changed, so a captured graph replays
// it. Block (128).
extern "C" __global__ void custody_tag_apply(const unsigned char* packed, custody_u32 n_layers,
                                            custody_u32 n_pages, custody_u32* generation,
                                            custody_u64* owner, custody_u64* stamp_owner,
                                            custody_u32* stamp_generation, custody_u32* filled) {
    const custody_u64 n = CUSTODY_LD((const custody_u64*)packed);
    const custody_u64* wide = (const custody_u64*)packed + 1;
    const custody_u32* narrow = (const custody_u32*)(packed + 8 + 16 * n);
    for (custody_u64 i = (custody_u64)blockIdx.x * CUSTODY_ATT_THREADS + threadIdx.x; i < n;
         i += (custody_u64)gridDim.x * CUSTODY_ATT_THREADS) {
        const custody_u32 page = CUSTODY_LD(narrow + i);
        if (page >= n_pages) continue;  // the host packs only pool pages; never write outside
        CUSTODY_ST(owner + page, CUSTODY_LD(wide + i));
        CUSTODY_ST(stamp_owner + page, CUSTODY_LD(wide + n + i));
        CUSTODY_ST(generation + page, CUSTODY_LD(narrow + n + i));
        CUSTODY_ST(stamp_generation + page, CUSTODY_LD(narrow + 2 * n + i));
        for (custody_u32 l = 0; l < n_layers; l++)
            CUSTODY_ST(filled + (custody_u64)l * n_pages + page,
                       CUSTODY_LD(narrow + (custody_u64)(3 + l) * n + i));
    }
}

// The transfer checksum on the GPU: XXH3-64 (seed 0, default secret) over a page's transferred
// bytes in transfer order — bit-identical to `kernels/src/checksum.rs` (and so to xxh3_64 of the
// chunks' concatenation), so a page hashed on a GPU node verifies on a CPU node and back.
//
// One block of 8 threads per page: thread j owns accumulator lane j (XXH3's lanes are
// independent until the final merge: lane j reads input words j and j^1 of each stripe), so the
// stripes are walked in order by every lane; the merge goes through shared memory and a barrier.
// Only XXH3's long-input algorithm (more than 240 bytes): the launcher refuses shorter pages (a
// page of one slot of the smallest supported model is kilobytes).
#include "custody.cuh"

__device__ const unsigned char CUSTODY_XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c,
    0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb,
    0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e,
    0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb,
    0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97,
    0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7,
    0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83,
    0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26,
    0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc,
    0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define CUSTODY_XXH3_STRIPE 64u
#define CUSTODY_XXH3_STRIPES_PER_BLOCK 16u
#define CUSTODY_XXH3_MID_MAX 240u

__device__ __forceinline__ custody_u64 custody_read64_secret(custody_u32 at) {
    custody_u64 v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | CUSTODY_XXH3_SECRET[at + i];
    return v;
}

// A forward-only cursor over a page's chunks (the concatenation is the hashed stream).
struct CustodyStream {
    const unsigned char* const* ptrs;
    const custody_u64* lens;
    custody_u32 n;
    custody_u32 chunk;   // current chunk
    custody_u64 start;   // stream offset of the current chunk's first byte
};

__device__ __forceinline__ unsigned char custody_stream_byte(CustodyStream* s, custody_u64 at) {
    // Offsets only move forward within a lane except for the last stripe, which rewinds once.
    if (at < s->start) {
        s->chunk = 0;
        s->start = 0;
    }
    while (s->chunk < s->n && at >= s->start + s->lens[s->chunk]) {
        s->start += s->lens[s->chunk];
        s->chunk++;
    }
    return s->ptrs[s->chunk][at - s->start];
}

// Little-endian 64-bit word at stream offset `at` (byte-wise: chunks need not be aligned).
__device__ __forceinline__ custody_u64 custody_stream_read64(CustodyStream* s, custody_u64 at) {
    custody_u64 v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | custody_stream_byte(s, at + (custody_u64)i);
    return v;
}

__device__ __forceinline__ custody_u64 custody_accumulate_lane(custody_u64 acc, custody_u64 own,
                                                                custody_u64 partner,
                                                                custody_u64 key) {
    const custody_u64 k = own ^ key;
    return acc + partner + (k & 0xFFFFFFFFull) * (k >> 32);
}

// Launch: grid (n_pages), block (8). `page_chunks[p]..page_chunks[p + 1]` index page p's chunks
// in `chunk_ptrs`/`chunk_lens`; `out[p]` receives its checksum.
extern "C" __global__ void custody_page_checksum(const unsigned char* const* chunk_ptrs,
                                                 const custody_u64* chunk_lens,
                                                 const custody_u32* page_chunks,
                                                 custody_u32 n_pages, custody_u64* out) {
    __shared__ custody_u64 lanes[8];
    const custody_u32 p = blockIdx.x;
    const custody_u32 j = threadIdx.x;
    if (p >= n_pages || j >= 8) return; // uniform per block: the grid is exact
    CustodyStream s;
    s.ptrs = chunk_ptrs + page_chunks[p];
    s.lens = chunk_lens + page_chunks[p];
    s.n = page_chunks[p + 1] - page_chunks[p];
    s.chunk = 0;
    s.start = 0;
    custody_u64 total = 0;
    for (custody_u32 c = 0; c < s.n; c++) total += s.lens[c];
    const custody_u64 init[8] = {0xC2B2AE3Dull, 0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full,
                                 0x165667B19E3779F9ull, 0x85EBCA77C2B2AE63ull, 0x85EBCA77ull,
                                 0x27D4EB2F165667C5ull, 0x9E3779B1ull};
    custody_u64 acc = init[j];
    // Every stripe but the last (XXH3 keeps the input's last 1..=64 bytes for the last stripe).
    const custody_u64 stripes = total > CUSTODY_XXH3_MID_MAX ? (total - 1) / CUSTODY_XXH3_STRIPE : 0;
    for (custody_u64 st = 0; st < stripes; st++) {
        const custody_u64 at = st * CUSTODY_XXH3_STRIPE;
        const custody_u32 in_block = (custody_u32)(st % CUSTODY_XXH3_STRIPES_PER_BLOCK);
        const custody_u64 own = custody_stream_read64(&s, at + 8 * j);
        const custody_u64 partner = custody_stream_read64(&s, at + 8 * (j ^ 1));
        acc = custody_accumulate_lane(acc, own, partner, custody_read64_secret(in_block * 8 + 8 * j));
        if ((st + 1) % CUSTODY_XXH3_STRIPES_PER_BLOCK == 0) {
            acc ^= acc >> 47;
            acc ^= custody_read64_secret(192 - 64 + 8 * j);
            acc *= 0x9E3779B1ull;
        }
    }
    if (total > CUSTODY_XXH3_MID_MAX) {
        // The last stripe: the input's last 64 bytes, the secret 7 bytes before its end.
        const custody_u64 at = total - CUSTODY_XXH3_STRIPE;
        const custody_u64 own = custody_stream_read64(&s, at + 8 * j);
        const custody_u64 partner = custody_stream_read64(&s, at + 8 * (j ^ 1));
        acc = custody_accumulate_lane(acc, own, partner, custody_read64_secret(192 - 64 - 7 + 8 * j));
    }
    lanes[j] = acc;
    __syncthreads();
    if (j != 0) return;
    if (total <= CUSTODY_XXH3_MID_MAX) {
        out[p] = 0; // refused by the launcher; never a real checksum of such a page
        return;
    }
    custody_u64 h = total * 0x9E3779B185EBCA87ull;
    for (int i = 0; i < 4; i++) {
        const custody_u64 a = lanes[2 * i] ^ custody_read64_secret(11 + 16 * i);
        const custody_u64 b = lanes[2 * i + 1] ^ custody_read64_secret(11 + 16 * i + 8);
        h += (a * b) ^ custody_mul_hi64(a, b);
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    out[p] = h ^ (h >> 32);
}

// The CUDA-on-CPU shim's scheduler (see cuda_shim.h).
#include "cuda_shim.h"

#include <stdio.h>
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace custody_shim {
thread_local Ids* current = nullptr;

namespace {
// Bytes of stack per fiber (kernels keep small frames; a 128-thread block is 8 MiB).
constexpr size_t STACK_BYTES = 64 << 10;

enum class State { Runnable, AtBarrier, AtWarp, Done };
constexpr unsigned WARP = 32;

// Switching: a fiber is entered the first time through its ucontext (makecontext sets up its
// stack), and from then on with _setjmp/_longjmp, which — unlike swapcontext — make no signal
// mask system call (two per switch would dominate a launch's time).
struct Fiber {
    ucontext_t ctx;
    jmp_buf jb;
    bool started = false;
    Ids ids;
    State state = State::Runnable;
    char* stack = nullptr;
    // A warp collective in progress: this lane's value, where it reads from, and the result.
    uint64_t deposit = 0, result = 0;
    unsigned (*src)(unsigned, unsigned) = nullptr;
    unsigned src_arg = 0;
    // An `mma` in progress instead of an exchange: this lane's fragments (on its stack, alive
    // while it waits).
    const MmaLane* mma = nullptr;
    // Counting: how many times this lane has executed each access site.
    std::unordered_map<const void*, uint32_t> site_runs;
};

// One warp-level memory instruction being assembled from its lanes' accesses.
struct Access {
    uint64_t addr;
    unsigned bytes;
};
struct Instruction {
    bool store = false;
    std::vector<Access> lanes;
};
struct InstructionKey {
    const void* site;
    uint64_t warp;
    uint32_t run;
    bool operator==(const InstructionKey& o) const {
        return site == o.site && warp == o.warp && run == o.run;
    }
};
struct InstructionKeyHash {
    size_t operator()(const InstructionKey& k) const {
        return std::hash<const void*>()(k.site) ^ (k.warp * 0x9E3779B97F4A7C15ull) ^
               ((uint64_t)k.run << 32);
    }
};

// Fiber stacks, kept for the OS thread's later blocks and launches: allocated once, never
// zeroed again (a block of 128 threads would otherwise clear 8 MiB before running).
thread_local std::vector<std::unique_ptr<char[]>> stacks;

char* stack_for(size_t i) {
    while (stacks.size() <= i) stacks.emplace_back(new char[STACK_BYTES]);
    return stacks[i].get();
}

struct Block {
    ucontext_t scheduler;
    jmp_buf scheduler_jb;
    std::vector<Fiber> fibers;
    size_t running = 0;
    Body body = nullptr;
    void* body_ctx = nullptr;
    std::unordered_map<InstructionKey, Instruction, InstructionKeyHash> instructions;
};

thread_local Block* block = nullptr;
thread_local Counts totals;
thread_local std::unordered_set<uint64_t> launch_sectors;

// Fold a finished block's warp-level instructions into the totals.
void fold_instructions(Block& b) {
    std::vector<uint64_t> sectors;
    for (auto& kv : b.instructions) {
        Instruction& ins = kv.second;
        sectors.clear();
        uint64_t bytes = 0;
        for (const Access& a : ins.lanes) {
            bytes += a.bytes;
            for (uint64_t s = a.addr / 32; s <= (a.addr + a.bytes - 1) / 32; s++) sectors.push_back(s);
        }
        std::sort(sectors.begin(), sectors.end());
        const uint64_t distinct = std::unique(sectors.begin(), sectors.end()) - sectors.begin();
        // The bytes asked for, each once (lanes reading one address share it).
        std::sort(ins.lanes.begin(), ins.lanes.end(),
                  [](const Access& x, const Access& y) { return x.addr < y.addr; });
        uint64_t unique = 0, end = 0;
        for (const Access& a : ins.lanes) {
            const uint64_t lo = std::max(a.addr, end), hi = a.addr + a.bytes;
            if (hi > lo) unique += hi - lo;
            end = std::max(end, hi);
        }
        totals.sectors += distinct;
        totals.ideal_sectors += (unique + 31) / 32;
        if (ins.store) {
            totals.store_bytes += bytes;
            totals.store_requests++;
        } else {
            totals.load_bytes += bytes;
            totals.load_requests++;
        }
    }
    b.instructions.clear();
}

void trampoline() {
    block->body(block->body_ctx);
    Fiber& f = block->fibers[block->running];
    f.state = State::Done;
    _longjmp(block->scheduler_jb, 1);
}

// Run fiber `f` until it reaches a barrier or returns.
void resume(Block& b, Fiber& f) {
    if (_setjmp(b.scheduler_jb) == 0) {
        if (!f.started) {
            f.started = true;
            swapcontext(&b.scheduler, &f.ctx);
        } else {
            _longjmp(f.jb, 1);
        }
    }
}

uint64_t next(uint64_t* s) {
    // xorshift64*: the schedule's permutation source.
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

int release_warps(Block& b, char* err, size_t err_len);

// IEEE binary16 bits → float (exact).
float half_bits_to_float(uint32_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {
        // Subnormal: value = mant · 2^-24, exactly representable as a float.
        float v = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// The warp's `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`, from every lane's fragments
// in the PTX ISA's layout (g = lane / 4, t = lane % 4; the lower half of a register is the
// lower-indexed element): A (16 × 16, row-major) reg 0 = A[g][2t, 2t+1], reg 1 = A[g+8][2t..],
// reg 2 = A[g][2t+8..], reg 3 = A[g+8][2t+8..]; B (16 × 8, col-major) reg 0 = B[2t, 2t+1][g],
// reg 1 = B[2t+8, 2t+9][g]; C and D (16 × 8 f32) element i = [g + 8·(i / 2)][2t + i % 2].
// D = A·B + C with f32 products of the exact halves, summed over k in order from C (the GPU's
// order within an mma is unspecified: the results may differ in the last bits).
// The warp's m16n8k32 int8 MMA from its lanes' fragments (PTX ISA layout: a0 A[g][4t..+4],
// a1 A[g+8][4t..], a2 A[g][16+4t..], a3 A[g+8][16+4t..]; b0 B[4t..+4][g], b1 B[16+4t..][g];
// c/d as the f16 MMA's).
void run_mma_s8(Block& b, size_t base) {
    int32_t A[16][32], B[32][8], C[16][8];
    const auto byte = [](unsigned w, unsigned i) { return (int32_t)(int8_t)(uint8_t)(w >> (8 * i)); };
    for (unsigned lane = 0; lane < WARP; lane++) {
        const MmaLane& m = *b.fibers[base + lane].mma;
        const unsigned g = lane / 4, t = lane % 4;
        for (unsigned r = 0; r < 4; r++)
            for (unsigned i = 0; i < 4; i++) A[g + 8 * (r % 2)][4 * t + 16 * (r / 2) + i] = byte(m.a[r], i);
        for (unsigned r = 0; r < 2; r++)
            for (unsigned i = 0; i < 4; i++) B[4 * t + 16 * r + i][g] = byte(m.b[r], i);
        for (unsigned i = 0; i < 4; i++) C[g + 8 * (i / 2)][2 * t + i % 2] = m.ci[i];
    }
    for (unsigned lane = 0; lane < WARP; lane++) {
        const MmaLane& m = *b.fibers[base + lane].mma;
        const unsigned g = lane / 4, t = lane % 4;
        for (unsigned i = 0; i < 4; i++) {
            const unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
            // Unsigned arithmetic: the s32 accumulation wraps, as the instruction's does.
            uint32_t acc = (uint32_t)C[row][col];
            for (unsigned k = 0; k < 32; k++) acc += (uint32_t)(A[row][k] * B[k][col]);
            m.di[i] = (int32_t)acc;
        }
    }
    for (size_t i = base; i < base + WARP; i++) b.fibers[i].mma = nullptr;
    totals.warp_collectives++;
}

void run_mma(Block& b, size_t base) {
    if (b.fibers[base].mma->di != nullptr) return run_mma_s8(b, base);
    float A[16][16], B[16][8], C[16][8];
    for (unsigned lane = 0; lane < WARP; lane++) {
        const MmaLane& m = *b.fibers[base + lane].mma;
        const unsigned g = lane / 4, t = lane % 4;
        for (unsigned r = 0; r < 4; r++) {
            const unsigned row = g + 8 * (r % 2), col = 2 * t + 8 * (r / 2);
            A[row][col] = half_bits_to_float(m.a[r] & 0xffffu);
            A[row][col + 1] = half_bits_to_float(m.a[r] >> 16);
        }
        for (unsigned r = 0; r < 2; r++) {
            B[2 * t + 8 * r][g] = half_bits_to_float(m.b[r] & 0xffffu);
            B[2 * t + 8 * r + 1][g] = half_bits_to_float(m.b[r] >> 16);
        }
        for (unsigned i = 0; i < 4; i++) C[g + 8 * (i / 2)][2 * t + i % 2] = m.c[i];
    }
    for (unsigned lane = 0; lane < WARP; lane++) {
        const MmaLane& m = *b.fibers[base + lane].mma;
        const unsigned g = lane / 4, t = lane % 4;
        for (unsigned i = 0; i < 4; i++) {
            const unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
            float acc = C[row][col];
            for (unsigned k = 0; k < 16; k++) acc += A[row][k] * B[k][col];
            m.d[i] = acc;
        }
    }
    for (size_t i = base; i < base + WARP; i++) b.fibers[i].mma = nullptr;
    totals.warp_collectives++;
}

// Run one block to completion. Returns 0 or -1 (message in err).
int run_block(Block& b, uint64_t* seed, char* err, size_t err_len) {
    const size_t n = b.fibers.size();
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; i++) order[i] = i;
    for (;;) {
        // A permutation per phase (seed 0: thread order).
        if (*seed != 0) {
            for (size_t i = n; i > 1; i--) {
                size_t j = next(seed) % i;
                size_t t = order[i - 1];
                order[i - 1] = order[j];
                order[j] = t;
            }
        }
        for (size_t k = 0; k < n; k++) {
            Fiber& f = b.fibers[order[k]];
            if (f.state != State::Runnable) continue;
            b.running = order[k];
            current = &f.ids;
            resume(b, f);
        }
        size_t done = 0, waiting = 0, at_warp = 0;
        for (auto& f : b.fibers) {
            if (f.state == State::Done) done++;
            if (f.state == State::AtBarrier) waiting++;
            if (f.state == State::AtWarp) at_warp++;
        }
        if (done == n) return 0;
        if (at_warp > 0) {
            if (release_warps(b, err, err_len) != 0) return -1;
            continue;
        }
        if (done > 0) {
            snprintf(err, err_len,
                     "divergent barrier: %zu of %zu threads wait at __syncthreads while %zu exited",
                     waiting, n, done);
            return -1;
        }
        for (auto& f : b.fibers) f.state = State::Runnable;  // everyone arrived: release
    }
}
// Release every warp whose live lanes all wait at a collective, computing each lane's result.
// A warp some of whose lanes wait elsewhere (exited, or at __syncthreads) is divergent.
int release_warps(Block& b, char* err, size_t err_len) {
    const size_t n = b.fibers.size();
    for (size_t base = 0; base < n; base += WARP) {
        const size_t end = std::min(n, base + WARP);
        size_t live = 0, waiting = 0;
        for (size_t i = base; i < end; i++) {
            if (b.fibers[i].state != State::Done) live++;
            if (b.fibers[i].state == State::AtWarp) waiting++;
        }
        if (waiting == 0) continue;
        if (waiting != live || live != end - base) {
            snprintf(err, err_len,
                     "divergent warp collective: %zu of %zu lanes of warp %zu wait at it while the others exited or wait at __syncthreads",
                     waiting, end - base, base / WARP);
            return -1;
        }
        size_t mmas = 0;
        for (size_t i = base; i < end; i++) mmas += b.fibers[i].mma != nullptr;
        size_t int8 = 0;
        for (size_t i = base; i < end; i++) int8 += b.fibers[i].mma && b.fibers[i].mma->di;
        if (int8 != 0 && int8 != mmas) {
            snprintf(err, err_len,
                     "divergent warp collective: %zu of %zu lanes of warp %zu wait at an int8 mma while the others wait at an f16 one",
                     int8, end - base, base / WARP);
            return -1;
        }
        if (mmas != 0 && mmas != end - base) {
            snprintf(err, err_len,
                     "divergent warp collective: %zu of %zu lanes of warp %zu wait at an mma while the others wait at another collective",
                     mmas, end - base, base / WARP);
            return -1;
        }
        if (mmas != 0) {
            run_mma(b, base);
        } else {
            for (size_t i = base; i < end; i++) {
                Fiber& f = b.fibers[i];
                const unsigned lane = (unsigned)(i - base);
                const size_t from = base + (f.src ? f.src(lane, f.src_arg) % WARP : lane);
                f.result = from < end ? b.fibers[from].deposit : f.deposit;
            }
        }
        for (size_t i = base; i < end; i++) b.fibers[i].state = State::Runnable;
        totals.warp_collectives++;
    }
    return 0;
}

// A fiber that starts in the kernel body. Its own function: `getcontext` returns twice (as
// `setjmp` does), so the launch loop's variables stay out of its frame.
__attribute__((noinline)) void make_fiber(Fiber& f, Ids ids, char* stack) {
    f.ids = ids;
    f.stack = stack;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, trampoline, 0);
}
}  // namespace

thread_local bool counting = false;

void count_begin() {
    totals = Counts{};
    launch_sectors.clear();
    counting = true;
}

Counts count_end() {
    counting = false;
    launch_sectors.clear();
    return totals;
}

void record(const void* site, const void* addr, unsigned bytes, bool store) {
    Fiber& f = block->fibers[block->running];
    const uint32_t run = f.site_runs[site]++;
    Instruction& ins = block->instructions[InstructionKey{site, block->running / WARP, run}];
    ins.store = store;
    ins.lanes.push_back(Access{(uint64_t)(uintptr_t)addr, bytes});
    const uint64_t a = (uint64_t)(uintptr_t)addr;
    for (uint64_t s = a / 32; s <= (a + bytes - 1) / 32; s++)
        if (launch_sectors.insert(s).second) totals.dram_sectors++;
}

uint64_t warp_exchange(uint64_t mine, unsigned (*src)(unsigned, unsigned), unsigned arg) {
    Fiber& f = block->fibers[block->running];
    f.deposit = mine;
    f.src = src;
    f.src_arg = arg;
    f.state = State::AtWarp;
    if (_setjmp(f.jb) == 0) _longjmp(block->scheduler_jb, 1);
    // Resumed: the fiber object is the same (the vector never grows while a block runs).
    Fiber& g = block->fibers[block->running];
    return g.result;
}

void syncwarp() {
    (void)warp_exchange(0, nullptr, 0);
}

void mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    // Copies: `d` may alias `c` (an accumulation), and the warp's D is computed from every
    // lane's inputs before any lane's output is written.
    float c_in[4] = {c[0], c[1], c[2], c[3]};
    MmaLane lane{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, c_in, d, nullptr, nullptr};
    Fiber& f = block->fibers[block->running];
    f.mma = &lane;
    (void)warp_exchange(0, nullptr, 0);
}

void mma_m16n8k32_s8(int* d, const unsigned* a, const unsigned* b, const int* c) {
    // Copies, as the f16 MMA's: `d` may alias `c`.
    int c_in[4] = {c[0], c[1], c[2], c[3]};
    MmaLane lane{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, nullptr, nullptr, c_in, d};
    Fiber& f = block->fibers[block->running];
    f.mma = &lane;
    (void)warp_exchange(0, nullptr, 0);
}

void syncthreads() {
    Fiber& f = block->fibers[block->running];
    f.state = State::AtBarrier;
    if (_setjmp(f.jb) == 0) _longjmp(block->scheduler_jb, 1);
}

int launch(dim3 grid, dim3 blk, uint64_t seed, Body body, void* ctx, char* err, size_t err_len) {
    const size_t n = (size_t)blk.x * blk.y * blk.z;
    uint64_t s = seed;
    launch_sectors.clear();  // DRAM sectors are counted per launch
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                Block b;
                b.body = body;
                b.body_ctx = ctx;
                b.fibers.resize(n);
                size_t i = 0;
                for (unsigned tz = 0; tz < blk.z; tz++)
                    for (unsigned ty = 0; ty < blk.y; ty++)
                        for (unsigned tx = 0; tx < blk.x; tx++, i++)
                            make_fiber(b.fibers[i], Ids{dim3(tx, ty, tz), dim3(bx, by, bz), blk, grid},
                                       stack_for(i));
                Block* outer = block;
                block = &b;
                int rc = run_block(b, &s, err, err_len);
                if (counting) fold_instructions(b);
                block = outer;
                current = nullptr;
                if (rc != 0) return rc;
            }
    return 0;
}
}  // namespace custody_shim

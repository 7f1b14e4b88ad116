// The CUDA-on-CPU shim's scheduler (see cuda_shim.h).
#include "cuda_shim.h"

#include <stdio.h>
#include <setjmp.h>
#include <ucontext.h>

#include <memory>
#include <vector>

namespace custody_shim {
thread_local Ids* current = nullptr;

namespace {
// Bytes of stack per fiber (kernels keep small frames; a 128-thread block is 8 MiB).
constexpr size_t STACK_BYTES = 64 << 10;

enum class State { Runnable, AtBarrier, Done };

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
};

thread_local Block* block = nullptr;

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
        size_t done = 0, waiting = 0;
        for (auto& f : b.fibers) {
            if (f.state == State::Done) done++;
            if (f.state == State::AtBarrier) waiting++;
        }
        if (done == n) return 0;
        if (done > 0) {
            snprintf(err, err_len,
                     "divergent barrier: %zu of %zu threads wait at __syncthreads while %zu exited",
                     waiting, n, done);
            return -1;
        }
        for (auto& f : b.fibers) f.state = State::Runnable;  // everyone arrived: release
    }
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

void syncthreads() {
    Fiber& f = block->fibers[block->running];
    f.state = State::AtBarrier;
    if (_setjmp(f.jb) == 0) _longjmp(block->scheduler_jb, 1);
}

int launch(dim3 grid, dim3 blk, uint64_t seed, Body body, void* ctx, char* err, size_t err_len) {
    const size_t n = (size_t)blk.x * blk.y * blk.z;
    uint64_t s = seed;
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
                block = outer;
                current = nullptr;
                if (rc != 0) return rc;
            }
    return 0;
}
}  // namespace custody_shim

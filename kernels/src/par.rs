//! The compute thread pool: persistent workers, spin-then-park hand-off, static partitioning.
//!
//! A decode step of SmolLM2 has ~180 parallel sections (six per layer); at ~10 ms a token, a
//! futex wake per section (what a work-stealing pool pays when its workers have gone to sleep)
//! costs a measurable share of the step. This pool is built for that shape instead:
//! - **Persistent workers, caller included.** A pool of `n` threads has `n - 1` workers; the
//!   thread that calls [`run`] is part 0, so a section costs one hand-off, not a wake of `n`.
//! - **Spin, then park.** A worker that finished a section spins on the section counter for
//!   [`SPIN_NS`] before it parks on a condition variable, so the next section (microseconds away
//!   inside a step) starts without a system call, and an idle pool uses no CPU.
//! - **Static partitioning.** A section is a closure of `(part, n_parts)`; part `i` always runs on
//!   worker `i`, so a kernel that splits its rows by part keeps every worker on the same rows
//!   every step. There is no stealing and no task queue: the number of tasks is bounded by the
//!   number of threads.
//!
//! # Invariants
//! - [`run`] returns only after every part has returned (also when one panicked: the panic is
//!   re-raised on the caller after all parts are done), which is what makes lending the
//!   closure's borrow to the workers sound.
//! - Results never depend on the thread count: kernels compute every output element with the
//!   same code whatever part it falls in (checked by tests at 1, 2 and 3 threads).
//! - One section at a time per pool (a mutex); a section started from inside a section, or with
//!   no pool installed, runs its parts one after another on the calling thread.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks. Longer than the gap between two sections of a
/// decode step (norms, RoPE, the KV write: microseconds), shorter than anything a user would
/// notice as a busy core.
pub const SPIN_NS: u64 = 200_000;

/// Most threads one pool runs (a bound on workers and on the parts of a section).
pub const MAX_THREADS: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("a compute pool runs at most {MAX_THREADS} threads, not {0}")]
    Threads(usize),
    #[error("starting compute worker {index}: {source}")]
    Spawn {
        index: usize,
        source: std::io::Error,
    },
}

/// A section's closure, with its borrow's lifetime erased (see [`run`]'s safety argument).
type Job = *const (dyn Fn(usize, usize) + Sync);

struct Shared {
    n_threads: usize,
    /// Bumped once per section; a worker runs the section whose number it has not seen yet.
    epoch: AtomicU64,
    /// The current section's closure; written before `epoch` is bumped (Release), read after.
    job: Mutex<Option<SendJob>>,
    /// Parts (other than the caller's) that finished the current section.
    done: AtomicUsize,
    /// A worker's part panicked in the current section.
    panicked: AtomicBool,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    /// One section at a time.
    section: Mutex<()>,
}

#[derive(Clone, Copy)]
struct SendJob(Job);
// SAFETY: the pointee is `Sync` (the `dyn Fn + Sync` bound) and outlives every use: `run` waits
// for every part before returning.
unsafe impl Send for SendJob {}

/// A compute pool of `n_threads` (the caller of a section plus `n_threads - 1` workers).
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.shared.n_threads)
            .finish()
    }
}

thread_local! {
    /// The pool installed on this thread (see [`ThreadPool::install`]).
    static CURRENT: Cell<Option<*const Shared>> = const { Cell::new(None) };
    /// This thread is running a part of a section (nested sections run inline).
    static IN_SECTION: Cell<bool> = const { Cell::new(false) };
}

impl ThreadPool {
    /// Start a pool of `n_threads` compute threads (`n_threads - 1` workers are spawned); 0 means
    /// one per available core.
    pub fn new(n_threads: usize) -> Result<Self, PoolError> {
        let n_threads = if n_threads == 0 {
            std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
        } else {
            n_threads
        };
        if n_threads > MAX_THREADS {
            return Err(PoolError::Threads(n_threads));
        }
        let shared = Arc::new(Shared {
            n_threads,
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            section: Mutex::new(()),
        });
        let mut pool = Self {
            shared: shared.clone(),
            workers: Vec::with_capacity(n_threads - 1),
        };
        for index in 1..n_threads {
            let s = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("custody-compute-{index}"))
                .spawn(move || worker_loop(&s, index))
                .map_err(|source| PoolError::Spawn { index, source })?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    pub fn current_num_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Run `f` with this pool as the calling thread's compute pool: every kernel section `f`
    /// starts on this thread is split over the pool's threads.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<*const Shared>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|c| c.replace(Some(Arc::as_ptr(&self.shared)))));
        f()
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _g = lock(&self.shared.lock);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a part panicked; the state it guards is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The process's default pool, used by threads that have none installed (a node's engine
/// thread). Unset, such threads compute alone.
static GLOBAL: std::sync::OnceLock<ThreadPool> = std::sync::OnceLock::new();

/// Make `pool` the process's default compute pool; refused (the pool handed back) if one is set.
pub fn set_global(pool: ThreadPool) -> Result<(), ThreadPool> {
    GLOBAL.set(pool)
}

/// The pool a section started on this thread would use: the installed one, else the global one;
/// none inside a section (nested sections run inline).
fn current() -> Option<&'static Shared> {
    if IN_SECTION.with(Cell::get) {
        return None;
    }
    match CURRENT.with(Cell::get) {
        // SAFETY: an installed pointer is valid while `install` runs (the `ThreadPool` is
        // borrowed for that long), and `CURRENT` is restored before `install` returns; the
        // reference does not escape the section or query that asked for it.
        Some(p) => Some(unsafe { &*p }),
        None => GLOBAL.get().map(|p| &*p.shared),
    }
}

/// Threads of the pool a section started here would use (1 when none, or inside a section).
pub fn current_num_threads() -> usize {
    current().map_or(1, |s| s.n_threads)
}

/// Run `f(part, n_parts)` for every `part` in `0..n_parts`, `n_parts` being the installed pool's
/// thread count: part 0 on the calling thread, part `i` on worker `i`. Returns when all parts
/// have returned; a panic in any part is re-raised here after that.
pub fn run(f: &(dyn Fn(usize, usize) + Sync)) {
    match current() {
        Some(s) if s.n_threads > 1 => run_on(s, f),
        _ => f(0, 1),
    }
}

fn run_on(s: &Shared, f: &(dyn Fn(usize, usize) + Sync)) {
    let _section = lock(&s.section);
    // SAFETY: lifetime erasure — the workers dereference this pointer only while running the
    // section published below, and this function does not return (nor unwind) before every
    // worker has reported that section done — so the borrow outlives every use.
    let job: Job = unsafe {
        std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), &'static (dyn Fn(usize, usize) + Sync)>(
            f,
        )
    };
    *lock(&s.job) = Some(SendJob(job));
    s.done.store(0, Ordering::SeqCst);
    s.panicked.store(false, Ordering::SeqCst);
    s.epoch.fetch_add(1, Ordering::SeqCst);
    if s.sleepers.load(Ordering::SeqCst) > 0 {
        let _g = lock(&s.lock);
        s.wake.notify_all();
    }
    IN_SECTION.with(|c| c.set(true));
    let mine = catch_unwind(AssertUnwindSafe(|| f(0, s.n_threads)));
    IN_SECTION.with(|c| c.set(false));
    let others = s.n_threads - 1;
    let mut spins = 0u32;
    while s.done.load(Ordering::Acquire) < others {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    *lock(&s.job) = None;
    debug_assert_eq!(
        s.done.load(Ordering::SeqCst),
        others,
        "every part reported once"
    );
    if let Err(p) = mine {
        resume_unwind(p);
    }
    assert!(
        !s.panicked.load(Ordering::SeqCst),
        "a compute worker panicked in a parallel section"
    );
}

fn worker_loop(s: &Shared, index: usize) {
    IN_SECTION.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        let epoch = wait_for_section(s, seen);
        seen = epoch;
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let job = lock(&s.job).expect("a section was published with its job");
        // SAFETY: the caller of `run_on` keeps the closure alive until this part reports done.
        let f = unsafe { &*job.0 };
        if catch_unwind(AssertUnwindSafe(|| f(index, s.n_threads))).is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

/// Spin for up to [`SPIN_NS`], then park, until the section counter passes `seen`.
fn wait_for_section(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let e = s.epoch.load(Ordering::Acquire);
        if e != seen {
            return e;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(256) {
            std::hint::spin_loop();
            continue;
        }
        if start.elapsed() < Duration::from_nanos(SPIN_NS) {
            continue;
        }
        // Park. `sleepers` is raised before the epoch is re-read (both SeqCst), and the caller
        // bumps the epoch before it reads `sleepers`: one of the two sees the other's write, so
        // a section is never published to a worker that then sleeps through it.
        let mut g = lock(&s.lock);
        s.sleepers.fetch_add(1, Ordering::SeqCst);
        while s.epoch.load(Ordering::SeqCst) == seen {
            g = s
                .wake
                .wait(g)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        s.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(g);
    }
}

/// The `part`-th of `n_parts` contiguous ranges of `0..n`, each a multiple of `align` long except
/// the last (`align` ≥ 1). Parts differ by less than `2 · align` items.
pub fn split(n: usize, part: usize, n_parts: usize, align: usize) -> std::ops::Range<usize> {
    debug_assert!(part < n_parts && align >= 1);
    let units = n.div_ceil(align);
    let (base, extra) = (units / n_parts, units % n_parts);
    let start = part * base + part.min(extra);
    let len = base + usize::from(part < extra);
    (start * align).min(n)..((start + len) * align).min(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_part_runs_once_per_section_on_its_own_worker() {
        for n in [1, 2, 3, 5] {
            let pool = ThreadPool::new(n).expect("pool");
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            let names: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
            pool.install(|| {
                assert_eq!(current_num_threads(), n);
                for _ in 0..1000 {
                    run(&|part, parts| {
                        assert_eq!(parts, n);
                        hits[part].fetch_add(1, Ordering::Relaxed);
                    });
                }
                run(&|part, _| {
                    let name = std::thread::current().name().unwrap_or("").to_owned();
                    lock(&names).push((part, name));
                });
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1000));
            for (part, name) in lock(&names).iter() {
                if *part > 0 {
                    assert_eq!(name, &format!("custody-compute-{part}"));
                }
            }
        }
    }

    #[test]
    fn without_a_pool_or_inside_a_section_parts_run_inline() {
        assert_eq!(current_num_threads(), 1);
        let count = AtomicU32::new(0);
        run(&|part, parts| {
            assert_eq!((part, parts), (0, 1));
            count.fetch_add(1, Ordering::Relaxed);
        });
        let pool = ThreadPool::new(2).expect("pool");
        pool.install(|| {
            run(&|_, _| {
                assert_eq!(current_num_threads(), 1);
                run(&|part, parts| {
                    assert_eq!((part, parts), (0, 1));
                    count.fetch_add(1, Ordering::Relaxed);
                });
            })
        });
        assert_eq!(count.load(Ordering::Relaxed), 3);
        assert_eq!(
            current_num_threads(),
            1,
            "install restores the previous pool"
        );
    }

    #[test]
    fn a_parked_pool_wakes_for_the_next_section() {
        let pool = ThreadPool::new(3).expect("pool");
        let count = AtomicU32::new(0);
        pool.install(|| {
            for _ in 0..3 {
                std::thread::sleep(Duration::from_nanos(SPIN_NS * 5));
                run(&|_, _| {
                    count.fetch_add(1, Ordering::Relaxed);
                });
            }
        });
        assert_eq!(count.load(Ordering::Relaxed), 9);
    }

    #[test]
    fn a_panicking_part_is_raised_on_the_caller_after_every_part_is_done() {
        let pool = ThreadPool::new(2).expect("pool");
        let finished = AtomicU32::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.install(|| {
                run(&|part, _| {
                    if part == 1 {
                        panic!("part 1 fails");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    finished.fetch_add(1, Ordering::SeqCst);
                })
            })
        }));
        assert!(r.is_err());
        assert_eq!(finished.load(Ordering::SeqCst), 1, "part 0 ran to its end");
        // The pool still works.
        let count = AtomicU32::new(0);
        pool.install(|| {
            run(&|_, _| {
                count.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn split_covers_the_range_in_aligned_balanced_parts() {
        for n in [0, 1, 7, 64, 960, 1001] {
            for parts in 1..6 {
                for align in [1, 4, 16] {
                    let ranges: Vec<_> = (0..parts).map(|p| split(n, p, parts, align)).collect();
                    let mut next = 0;
                    for r in &ranges {
                        assert_eq!(r.start, next);
                        assert!(r.start == n || r.start % align == 0);
                        next = r.end;
                    }
                    assert_eq!(next, n);
                    let lens: Vec<_> = ranges.iter().map(|r| r.len()).collect();
                    let (lo, hi) = (lens.iter().min(), lens.iter().max());
                    assert!(
                        hi.unwrap_or(&0) - lo.unwrap_or(&0) < 2 * align,
                        "{n} {parts} {align}"
                    );
                }
            }
        }
        assert!(ThreadPool::new(MAX_THREADS + 1).is_err());
        assert!(
            ThreadPool::new(0)
                .expect("one per core")
                .current_num_threads()
                >= 1
        );
    }
}

//! Masks computed ahead, off the engine's step: a constraint's next mask depends only on the
//! tokens already sampled, so it is started on this pool as soon as the sampled token is
//! accepted and computed while the engine runs the next forward pass; the step that samples
//! only waits for whatever is left of it (SGLang's overlap scheduler hides its grammar masks
//! behind the forward pass in the same spirit). A step that needs a mask whose job has not
//! started claims it and computes it itself (`Constraint::allowed`), so computing ahead never
//! costs a step more than computing on the step. The threads are idle-class (`idle_class`).
//!
//! Bounded: a fixed set of threads behind a queue of [`QUEUE_JOBS`]; when the queue is full
//! the job is handed back and the mask is computed when it is needed, on the step.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, OnceLock};

/// Jobs waiting at most: a mask for each sequence of a few full batches.
pub const QUEUE_JOBS: usize = 1024;
/// Threads at most (fewer on smaller hosts: one per core).
pub const MAX_THREADS: usize = 8;

pub(crate) type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    tx: SyncSender<Job>,
}

/// The process's pool, started on first use; `None` if no thread could be started (masks are
/// then computed on the step).
fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, MAX_THREADS);
        let (tx, rx) = sync_channel::<Job>(QUEUE_JOBS);
        let rx = Arc::new(Mutex::new(rx));
        let mut started = 0;
        for i in 0..threads {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("custody-mask-{i}"))
                .spawn(move || work(&rx));
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "cannot start a mask thread"),
            }
        }
        (started > 0).then_some(Pool { tx })
    })
    .as_ref()
}

/// Runs the calling thread only when a core would otherwise idle (Linux `SCHED_IDLE`): on the
/// CPU backend the forward pass's workers use every core and partition each section
/// statically, so a mask thread that preempted one would stall the whole section; idle-class,
/// it fills the gaps (a worker parked, the engine thread waiting) and, at worst, runs when the
/// step waits for its mask. With the forward pass on a GPU the cores are free and it just runs.
#[cfg(target_os = "linux")]
pub(crate) fn idle_class() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` outlives the call, which only reads it.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "mask thread keeps the normal scheduling class"
        );
    }
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn idle_class() {}

fn work(rx: &Mutex<Receiver<Job>>) {
    idle_class();
    loop {
        // Poisoned only by a panic while holding the receiver's lock, which `recv` does not
        // do: take it back either way.
        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(job) => job,
            Err(_) => return, // The sender (a static) is gone: the process is ending.
        };
        // A job that panics loses its result (its waiter sees the channel closed and reports
        // an error); the thread lives on for the next one.
        if catch_unwind(AssertUnwindSafe(job)).is_err() {
            tracing::error!("a mask job panicked");
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(true);
static STEP_MASKS: AtomicU64 = AtomicU64::new(0);
static STEP_NS: AtomicU64 = AtomicU64::new(0);

/// What constraints have cost the steps that ran them, since the process started: masks
/// applied (one per constrained token), and the time the step spent in the constraint's
/// calls — waiting for the mask computed ahead or computing it there, applying it to the
/// logits, advancing past the sampled token and starting the next mask. Summed over
/// sequences, whichever thread made the call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OnStep {
    pub masks: u64,
    pub on_step_ns: u64,
}

impl OnStep {
    /// The counters now.
    pub fn now() -> Self {
        Self {
            masks: STEP_MASKS.load(Ordering::Relaxed),
            on_step_ns: STEP_NS.load(Ordering::Relaxed),
        }
    }

    /// What happened between `earlier` and `self`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            masks: self.masks.saturating_sub(earlier.masks),
            on_step_ns: self.on_step_ns.saturating_sub(earlier.on_step_ns),
        }
    }

    /// Mean time on the step per constrained token, µs.
    pub fn mean_on_step_us(self) -> f64 {
        self.on_step_ns as f64 / 1e3 / self.masks.max(1) as f64
    }
}

/// Adds the time until it is dropped to [`OnStep`]'s.
pub(crate) struct OnStepTimer(std::time::Instant);

impl OnStepTimer {
    pub(crate) fn start() -> Self {
        Self(std::time::Instant::now())
    }
}

impl Drop for OnStepTimer {
    fn drop(&mut self) {
        let ns = u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        STEP_NS.fetch_add(ns, Ordering::Relaxed);
    }
}

/// Counts one mask applied ([`OnStep::masks`]).
pub(crate) fn count_mask() {
    STEP_MASKS.fetch_add(1, Ordering::Relaxed);
}

/// Whether masks are computed ahead (on by default). Off, every mask is computed on the step
/// that needs it: for measuring what the overlap saves (`custody bench --constraint-cost`);
/// the masks are the same either way.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Runs `job` on the pool, or hands it back when the pool is full or absent, or computing
/// ahead is off.
pub(crate) fn submit(job: Job) -> Result<(), Job> {
    if !ENABLED.load(Ordering::Relaxed) {
        return Err(job);
    }
    let Some(pool) = pool() else {
        return Err(job);
    };
    pool.tx.try_send(job).map_err(|e| match e {
        TrySendError::Full(job) | TrySendError::Disconnected(job) => job,
    })
}

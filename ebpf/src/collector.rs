//! The collector: ring buffer → audit rows (`rdma_ops`, `rdma_mr`) through an [`AuditSink`]
//! (the audit writer: sealed and chained like every other table), plus `node_events` rows for the
//! witness's own facts — what it attached to, and every increase of its lost-event counters.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use custody_audit::{AuditSink, Event, RdmaOpRows, SinkError, mono_now_ns, thread_cpu_ns};

use crate::event::Observation;
use crate::witness::{Lost, Witness, WitnessError};

#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error(transparent)]
    Witness(#[from] WitnessError),
    #[error("the audit sink refused a witness row: {0}")]
    Sink(#[from] SinkError),
}

/// Records handed per poll: bounds the time between checks of `stop` and of the counters.
const RECORDS_PER_POLL: usize = 4096;
/// How often the lost-event counters are read and any increase recorded.
const LOST_CHECK_PERIOD: Duration = Duration::from_secs(1);

/// Converts `bpf_ktime_get_ns` (CLOCK_MONOTONIC) to the audit clock ([`mono_now_ns`]), which
/// counts from this process's first use of it. Both are CLOCK_MONOTONIC, so one offset, taken
/// once, converts every record (the writer then anchors the audit clock to wall-clock time).
#[derive(Clone, Copy, Debug)]
pub struct ClockMap {
    offset_ns: u64,
}

impl ClockMap {
    pub fn now() -> Self {
        let audit = mono_now_ns();
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let raw = (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64;
        Self {
            offset_ns: raw.saturating_sub(audit),
        }
    }

    fn audit_ns(&self, ktime_ns: u64) -> u64 {
        ktime_ns.saturating_sub(self.offset_ns)
    }
}

/// What a collection run saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CollectStats {
    pub ops: u64,
    pub registrations: u64,
    pub lost: Lost,
    /// CPU time of the collecting thread over the run (decoding, converting, handing off), ns.
    pub cpu_ns: u64,
}

fn node_event(kind: &str, detail: String) -> Event {
    Event::Node {
        ts_ns: mono_now_ns(),
        kind: kind.to_owned(),
        detail,
    }
}

/// Record the witness's start (what it attached to) into `sink`.
pub fn record_start(w: &Witness, target: &str, sink: &dyn AuditSink) -> Result<(), SinkError> {
    let points: Vec<String> = w
        .attached()
        .iter()
        .map(|a| {
            format!(
                "{}={}:{}@{:#x}{}",
                a.program,
                a.binary.display(),
                a.symbol,
                a.file_offset,
                a.version
                    .as_deref()
                    .map(|v| format!(" ({v})"))
                    .unwrap_or_default()
            )
        })
        .collect();
    sink.record(node_event(
        "witness_start",
        format!("target {target}; attached {}", points.join(", ")),
    ))
}

/// Read the witness until `stop` is set (then drain what is left), recording every observation.
/// Every increase of the lost-event counters is recorded as a `witness_lost` node event and
/// logged at WARN; the final counts are in the returned stats and a `witness_stop` row.
pub fn run(
    w: &mut Witness,
    sink: &dyn AuditSink,
    stop: &AtomicBool,
    poll_interval: Duration,
) -> Result<CollectStats, CollectError> {
    run_with(w, sink, stop, poll_interval, true)
}

/// [`run`], choosing whether each write's scatter/gather entries are recorded
/// ([`crate::WitnessConfig::record_sges`]).
pub fn run_with(
    w: &mut Witness,
    sink: &dyn AuditSink,
    stop: &AtomicBool,
    poll_interval: Duration,
    record_sges: bool,
) -> Result<CollectStats, CollectError> {
    let cpu_start_ns = thread_cpu_ns();
    let clock = ClockMap::now();
    let mut stats = CollectStats::default();
    let mut reported = Lost::default();
    let mut last_check = Instant::now();
    // One hand-off to the sink per poll, not one per record: operations as columns
    // (`record_rdma_ops`: no event per row), registrations (few) as events, handed over first
    // (a region is registered before writes into it).
    let mut batch: Vec<Event> = Vec::new();
    let mut ops = RdmaOpRows::default();
    loop {
        let stopping = stop.load(Ordering::Acquire);
        let n = w.poll(
            if stopping {
                Duration::ZERO
            } else {
                poll_interval
            },
            RECORDS_PER_POLL,
            |mut o| {
                if !record_sges {
                    o.sges.clear();
                }
                count(&o, &mut stats);
                let ts_ns = clock.audit_ns(o.ktime_ns);
                if o.kind.is_registration() {
                    batch.push(o.to_event(ts_ns));
                } else {
                    ops.push(o.to_rdma_op(ts_ns));
                }
            },
        )?;
        // A ring record carries up to POST_BATCH_WRS observations (a batch of posted work
        // requests); `RECORDS_PER_POLL` bounds records, so this bounds what one poll hands over.
        debug_assert!(batch.len() + ops.len() <= RECORDS_PER_POLL * crate::event::POST_BATCH_WRS);
        if !batch.is_empty() {
            sink.record_all(std::mem::take(&mut batch))?;
        }
        if !ops.is_empty() {
            let cap = ops.len();
            sink.record_rdma_ops(std::mem::replace(&mut ops, RdmaOpRows::with_capacity(cap)))?;
        }
        if stopping && n == 0 {
            break;
        }
        if last_check.elapsed() >= LOST_CHECK_PERIOD {
            last_check = Instant::now();
            report_lost(w, sink, &mut reported)?;
        }
    }
    report_lost(w, sink, &mut reported)?;
    stats.lost = reported;
    stats.cpu_ns = thread_cpu_ns().saturating_sub(cpu_start_ns);
    sink.record(node_event(
        "witness_stop",
        format!(
            "ops {} registrations {} lost {}",
            stats.ops, stats.registrations, reported
        ),
    ))?;
    Ok(stats)
}

fn count(o: &Observation, stats: &mut CollectStats) {
    if o.kind.is_registration() {
        stats.registrations += 1;
    } else {
        stats.ops += 1;
    }
}

fn report_lost(w: &Witness, sink: &dyn AuditSink, reported: &mut Lost) -> Result<(), CollectError> {
    let now = w.lost()?;
    if now.total() > reported.total() {
        tracing::warn!(lost = %now, "the witness lost events (recorded in node_events)");
        sink.record(node_event("witness_lost", now.to_string()))?;
    }
    *reported = now;
    Ok(())
}

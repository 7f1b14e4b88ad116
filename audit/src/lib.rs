//! Custody's audit log.
//!
//! - [`Event`] and its parts: what the engine records about every KV page it touches (always
//!   compiled; no heavy dependencies).
//! - [`AuditSink`]: the trait the engine emits into. The runtime knows only this.
//! - With the `writer` feature: the Arrow schema ([`schema`]), the append-only writer
//!   ([`writer`]: bounded queue → record batches → Arrow IPC live segment → sealed Parquet in
//!   Hive-style partitions), and the Ed25519 digest chain with `verify` ([`digest`]); and a
//!   deterministic synthetic log at scale with injected exposures of known answer ([`synth`]).
//!
//! Architecture invariant: this crate knows nothing of the runtime. It defines events, writes,
//! seals and verifies them.

#[cfg(feature = "writer")]
pub mod digest;
#[cfg(feature = "writer")]
pub mod schema;
#[cfg(feature = "writer")]
pub mod synth;
#[cfg(feature = "writer")]
pub mod writer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Nanoseconds on the node's monotonic clock (the writer anchors it to wall-clock time).
pub type MonoNs = u64;

/// Process-wide monotonic clock for audit timestamps, in nanoseconds since first use.
pub fn mono_now_ns() -> MonoNs {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}

/// The calling thread's CPU time so far, in nanoseconds (Linux `schedstat`: time on CPU); 0
/// where unreadable. How the writer and the witness's collector report their own cost.
pub fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(0)
}

/// A request's lifecycle event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestKind {
    Admitted,
    Rejected { reason: String },
    Aborted,
    Finished { reason: String },
    Failed { reason: String },
}

impl RequestKind {
    pub fn name(&self) -> &'static str {
        match self {
            RequestKind::Admitted => "admitted",
            RequestKind::Rejected { .. } => "rejected",
            RequestKind::Aborted => "aborted",
            RequestKind::Finished { .. } => "finished",
            RequestKind::Failed { .. } => "failed",
        }
    }
    pub fn reason(&self) -> Option<&str> {
        match self {
            RequestKind::Rejected { reason }
            | RequestKind::Finished { reason }
            | RequestKind::Failed { reason } => Some(reason),
            RequestKind::Admitted | RequestKind::Aborted => None,
        }
    }
}

/// Who wrote a page's slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    /// Computed on this node.
    Local,
    /// Received from another node (disaggregated transfer).
    Transfer,
}

/// A page lifecycle event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageKind {
    Alloc,
    /// Slots `slot_start..slot_end` written (all layers) in this generation.
    Write {
        slot_start: u32,
        slot_end: u32,
        writer: Writer,
    },
    Release,
    Quarantine,
    Zero,
}

impl PageKind {
    pub fn name(&self) -> &'static str {
        match self {
            PageKind::Alloc => "alloc",
            PageKind::Write { .. } => "write",
            PageKind::Release => "release",
            PageKind::Quarantine => "quarantine",
            PageKind::Zero => "zero",
        }
    }
}

/// One audit event. Every variant names the request and tenant it concerns. (The tenant is an
/// `Arc<str>`: the hot path clones a pointer, not a string.)
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Request {
        ts_ns: MonoNs,
        request: u64,
        tenant: Arc<str>,
        kind: RequestKind,
        prompt_tokens: u32,
        output_tokens: u32,
    },
    Page {
        ts_ns: MonoNs,
        request: u64,
        tenant: Arc<str>,
        page: u32,
        generation: u32,
        kind: PageKind,
    },
    /// Run-length read record: request attended slots `slot_start..slot_end` of `(page,
    /// generation)` at every decode step from `first_step` to `last_step` (inclusive), all
    /// verified by the tag check. Flushed when the request ends.
    Read {
        ts_ns: MonoNs,
        request: u64,
        tenant: Arc<str>,
        page: u32,
        generation: u32,
        slot_start: u32,
        slot_end: u32,
        first_step: u32,
        last_step: u32,
        /// Whether the tag check verified these reads (false only with the check disabled by
        /// the incident reproduction: the slots were read unchecked).
        verified: bool,
    },
    Transfer {
        ts_ns: MonoNs,
        transfer: u64,
        request: u64,
        tenant: Arc<str>,
        src_node: u32,
        src_page: u32,
        src_generation: u32,
        dst_node: u32,
        dst_page: u32,
        dst_generation: u32,
        bytes: u64,
        checksum: u64,
        outcome: String,
        /// Where the writes went (the transport's key and the page's address in its region) and
        /// what went out: the page's span in the region (`remote_len`), the bytes of every
        /// work request of its chain (`wire_bytes`, header included) and their number. What the
        /// eBPF witness's observed writes are checked against (`custody forensics crosscheck`).
        rkey: u32,
        remote_addr: u64,
        remote_len: u64,
        wire_bytes: u64,
        work_requests: u32,
    },
    /// Observed by the eBPF witness (not by the engine): a posted work request, a completion, or
    /// an RDMA queue-pair call. Boxed: the engine's hot-path events stay small.
    RdmaOp(Box<RdmaOp>),
    /// Observed by the eBPF witness: a memory region registered or invalidated (the transport's
    /// probe points, or libibverbs' `ibv_reg_mr` / `ibv_dereg_mr`).
    RdmaMr(Box<RdmaMr>),
    /// A fact about the node itself: `start` (role, configuration), `unsafe_reproduction`
    /// (the incident's faults armed on this node, by name). Names no request.
    Node {
        ts_ns: MonoNs,
        kind: String,
        detail: String,
    },
    /// The tag check refused a read or write.
    IntegrityViolation {
        ts_ns: MonoNs,
        request: u64,
        tenant: Arc<str>,
        page: Option<u32>,
        generation: Option<u32>,
        kind: String,
        detail: String,
    },
}

impl Event {
    pub fn ts_ns(&self) -> MonoNs {
        match self {
            Event::Request { ts_ns, .. }
            | Event::Page { ts_ns, .. }
            | Event::Read { ts_ns, .. }
            | Event::Transfer { ts_ns, .. }
            | Event::IntegrityViolation { ts_ns, .. }
            | Event::Node { ts_ns, .. } => *ts_ns,
            Event::RdmaOp(o) => o.ts_ns,
            Event::RdmaMr(m) => m.ts_ns,
        }
    }
}

/// One operation on the RDMA transfer path, as the eBPF witness saw it (table `rdma_ops`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RdmaOp {
    /// The collector's monotonic clock (converted from `ktime_ns`).
    pub ts_ns: MonoNs,
    /// `bpf_ktime_get_ns` at the probe hit (CLOCK_MONOTONIC, ns).
    pub ktime_ns: u64,
    pub pid: u32,
    pub tid: u32,
    /// `post_write`, `complete`, `create_qp`, `modify_qp`, `destroy_qp`.
    pub op: &'static str,
    /// The transport's probe context (`(node << 32) | instance`); ibv calls: the QP pointer.
    pub ctx: u64,
    pub wr_id: u64,
    /// Position of the work request in its posted chain.
    pub chain_index: u32,
    /// Work-request opcode (`post_write`), completion opcode (`complete`), QP type (`create_qp`).
    pub opcode: u32,
    /// Send flags (`post_write`), attribute mask (`modify_qp`).
    pub flags: u32,
    /// Immediate data, host byte order.
    pub imm: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    /// Scatter/gather entries as posted.
    pub num_sge: u32,
    /// Sum of the decoded entries' lengths (`post_write`), `byte_len` (`complete`).
    pub bytes: u64,
    /// Completion status (`complete`), return value (ibv calls), target state (`modify_qp`).
    pub status: i32,
    pub qp_num: u32,
    /// `addr:length:lkey` per decoded scatter/gather entry, space-separated (`post_write`).
    pub sges: Option<String>,
    /// What the probe could not see: `read_fault`, `sge_truncated`, `no_entry` (comma-separated).
    pub probe_flags: Option<String>,
}

/// A memory registration seen by the eBPF witness (table `rdma_mr`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RdmaMr {
    pub ts_ns: MonoNs,
    pub ktime_ns: u64,
    pub pid: u32,
    pub tid: u32,
    /// `register`, `invalidate` (the transport's probe points), `ibv_reg_mr`, `ibv_dereg_mr`.
    pub op: &'static str,
    /// Probe context (transport) or the `struct ibv_mr` pointer (ibv).
    pub ctx: u64,
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
    /// `ibv_reg_mr` access flags.
    pub access: u32,
    /// Return value (ibv calls; -1 for a null `ibv_mr`), 0 for the transport's.
    pub status: i32,
    pub probe_flags: Option<String>,
}

/// Why an event could not be recorded. The engine treats any error as "stop serving" (safety
/// property 4: no unrecorded access).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    #[error("audit log is closed: {0}")]
    Closed(String),
}

/// Where the engine sends its events. `record` must be cheap and must not drop silently: it either
/// accepts the event (possibly waiting for queue space) or returns an error.
pub trait AuditSink: Send + Sync + std::fmt::Debug {
    fn record(&self, event: Event) -> Result<(), SinkError>;

    /// Record `events` in order: the same as [`AuditSink::record`] on each, handed off at once
    /// where the sink can (the writer: one queue message for the lot, so a producer with many
    /// events at hand — the eBPF witness's collector draining its ring buffer — pays one
    /// hand-off, not one per event).
    fn record_all(&self, events: Vec<Event>) -> Result<(), SinkError> {
        for e in events {
            self.record(e)?;
        }
        Ok(())
    }
}

/// A sink that discards everything (audit off). Named as such: only for `--no-audit` runs and the
/// audit-cost benchmark.
#[derive(Debug, Default)]
pub struct DiscardSink {
    pub count: AtomicU64,
}

impl AuditSink for DiscardSink {
    fn record(&self, _event: Event) -> Result<(), SinkError> {
        self.count.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn record_all(&self, events: Vec<Event>) -> Result<(), SinkError> {
        self.count.fetch_add(events.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// An in-memory sink for tests.
#[derive(Debug, Default, Clone)]
pub struct MemorySink {
    pub events: Arc<Mutex<Vec<Event>>>,
}

impl AuditSink for MemorySink {
    fn record(&self, event: Event) -> Result<(), SinkError> {
        self.events
            .lock()
            .map_err(|e| SinkError::Closed(e.to_string()))?
            .push(event);
        Ok(())
    }
}

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
pub mod checkpoint;
#[cfg(feature = "writer")]
pub mod config;
#[cfg(feature = "tlog")]
pub mod cosign;
#[cfg(feature = "writer")]
pub mod defaults;
#[cfg(feature = "writer")]
pub mod digest;
#[cfg(feature = "writer")]
pub mod leaf;
#[cfg(feature = "writer")]
pub mod notice;
#[cfg(feature = "tlog")]
pub mod promise;
#[cfg(feature = "writer")]
pub mod request_index;
#[cfg(feature = "writer")]
pub mod schema;
#[cfg(feature = "writer")]
pub mod synth;
#[cfg(feature = "tlog")]
pub mod tlog;
#[cfg(feature = "tlog")]
pub mod tlog_witness;
#[cfg(feature = "writer")]
pub mod tree_store;
#[cfg(feature = "writer")]
pub mod writer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A node's side of a peer checkpoint exchange, as the runtime sees it: checkpoints travel as
/// opaque signed JSON (the `writer` feature's `checkpoint::PeerExchange` implements it over the
/// node's own writer), so the runtime needs none of the writer's dependencies.
pub trait CheckpointExchange: Send + Sync + std::fmt::Debug {
    /// This node's newest checkpoint (JSON); none before its writer issued one.
    fn own(&self) -> Option<String>;
    /// Keep in this node's log a checkpoint another node sent; returns whether it was new.
    /// Blocking: the log's bounded queue may make the recording wait.
    fn keep(&self, json: &str) -> Result<bool, ExchangeRefused>;
}

/// Why a checkpoint another node sent was not kept.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeRefused {
    #[error("not a checkpoint: {0}")]
    Malformed(String),
    #[error("a checkpoint of node {0} is this node's own: a peer cannot speak for it")]
    OwnNode(u32),
    #[error("this node's log refused it: {0}")]
    Log(String),
}

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
    Rejected {
        reason: String,
    },
    /// Ended before the engine finished it: `reason` says by whom or why (`client_disconnected`,
    /// the drain, the audit log, a transfer failure, …).
    Aborted {
        reason: String,
    },
    Finished {
        reason: String,
    },
    Failed {
        reason: String,
    },
}

impl RequestKind {
    pub fn name(&self) -> &'static str {
        match self {
            RequestKind::Admitted => "admitted",
            RequestKind::Rejected { .. } => "rejected",
            RequestKind::Aborted { .. } => "aborted",
            RequestKind::Finished { .. } => "finished",
            RequestKind::Failed { .. } => "failed",
        }
    }
    pub fn reason(&self) -> Option<&str> {
        match self {
            RequestKind::Rejected { reason }
            | RequestKind::Aborted { reason }
            | RequestKind::Finished { reason }
            | RequestKind::Failed { reason } => Some(reason),
            RequestKind::Admitted => None,
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
    /// Restored from a KV offload tier, verified: the row names the page's original writer.
    Restore,
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
    /// A request's decoding options (constraint, log-probabilities, biases, penalties).
    Decoding(Box<DecodingRecord>),
    /// The tools a request offered and the ones its answer called (table `request_tools`),
    /// recorded when the answer is parsed.
    Tools(Box<ToolsRecord>),
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
    /// A prefix-cache fact (table `prefix_cache`): a page shared into a namespace by the request
    /// that wrote it, a hit (one row per page a request attends without computing it), or an
    /// eviction (the page returned to the pool).
    Cache(Box<CacheRecord>),
    /// A KV offload fact (table `kv_offload`): a page stored in a tier, restored into the pool,
    /// or gone from its last tier.
    Offload(Box<OffloadRecord>),
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
            Event::Cache(c) => c.ts_ns,
            Event::Offload(o) => o.ts_ns,
            Event::Decoding(d) => d.ts_ns,
            Event::Tools(t) => t.ts_ns,
        }
    }
}

/// One operation on the RDMA transfer path, as the eBPF witness saw it (table `rdma_ops`).
/// What a [`CacheRecord`] says happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// The writer handed its fully written page to the namespace (read-only from now on).
    Share,
    /// A request attends the cached page instead of computing it.
    Hit,
    /// The page left the cache and returned to the pool's free list.
    Evict,
}

impl CacheEvent {
    pub fn name(self) -> &'static str {
        match self {
            CacheEvent::Share => "share",
            CacheEvent::Hit => "hit",
            CacheEvent::Evict => "evict",
        }
    }
}

/// What an [`OffloadRecord`] says happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffloadEvent {
    /// The page was stored in a tier: evicted from the pool into the first, or moved down.
    Offload,
    /// The page was verified and restored into the pool for a reader (a hit).
    Restore,
    /// The page left its last tier (over budget), or was deleted because it failed
    /// verification.
    Evict,
}

impl OffloadEvent {
    pub fn name(self) -> &'static str {
        match self {
            OffloadEvent::Offload => "offload",
            OffloadEvent::Restore => "restore",
            OffloadEvent::Evict => "evict",
        }
    }
}

/// One `kv_offload` row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadRecord {
    pub ts_ns: MonoNs,
    pub event: OffloadEvent,
    /// Offload, evict: the page's writer (0 and "" when only its key is known); restore: the
    /// reader.
    pub request: u64,
    pub tenant: Arc<str>,
    /// `host`, `disk` or `object`.
    pub tier: &'static str,
    /// The pool page it left (an offload from the pool) or entered (a restore), and its
    /// generation there.
    pub page: Option<u32>,
    pub generation: Option<u32>,
    /// The key the tier stores it under (SHA-256 chain key).
    pub key: [u8; 32],
    /// The page's namespace tag, scope and scope kind, when known.
    pub namespace: Option<u64>,
    pub scope: Option<Arc<str>>,
    /// The page's original writer: node, request, tenant.
    pub writer_node: Option<u32>,
    pub writer_request: Option<u64>,
    pub writer_tenant: Option<Arc<str>>,
    /// The page's K/V bytes (0 when only its key is known).
    pub bytes: u64,
    /// Evict: why (`budget`, `refused`); restore: the reader's namespace when the unsafe
    /// token-only reproduction restored another namespace's page into it.
    pub detail: Option<String>,
}

/// One `request_decoding` row: what an admitted request asked of its sampled tokens beyond
/// temperature and `top_p`, recorded only when it asked for something (no row: a plain
/// request).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodingRecord {
    pub ts_ns: MonoNs,
    pub request: u64,
    pub tenant: Arc<str>,
    /// `json_object`, `json_schema`, `lark`, `regex`; `None`: unconstrained.
    pub constraint_kind: Option<&'static str>,
    /// SHA-256 of the constraint's kind and text (`grammar::ConstraintSpec::sha256_hex`).
    pub constraint_sha256: Option<String>,
    /// Choices the request asked for.
    pub n: u32,
    /// `Some(k)`: log-probabilities with `k` alternatives per token.
    pub top_logprobs: Option<u32>,
    pub logit_bias_tokens: u32,
    /// Penalties × 1000, rounded.
    pub presence_penalty_milli: i32,
    pub frequency_penalty_milli: i32,
}

/// One `request_tools` row: a request that offered tools, and what its answer called.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolsRecord {
    pub ts_ns: MonoNs,
    pub request: u64,
    pub tenant: Arc<str>,
    /// How the template writes calls: `hermes`, `llama3_json`, `mistral`.
    pub format: &'static str,
    /// `auto`, `required`, `function:<name>`.
    pub tool_choice: String,
    /// The offered functions' names, in request order.
    pub offered: Vec<String>,
    /// The called functions' names, in call order (empty: the answer was text).
    pub called: Vec<String>,
}

/// One `prefix_cache` row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheRecord {
    pub ts_ns: MonoNs,
    pub event: CacheEvent,
    /// Share: the writer; hit: the reader; evict: the writer.
    pub request: u64,
    pub tenant: Arc<str>,
    pub page: u32,
    pub generation: u32,
    /// The namespace's tag (the shared page's owner value in the pool).
    pub namespace: u64,
    /// `tenant`, `tenant+salt`, `public:<name>`, `unsafe:global`.
    pub scope: Arc<str>,
    /// `tenant`, `public` or `unsafe`.
    pub scope_kind: &'static str,
    /// The request that computed the page, and its tenant.
    pub writer: u64,
    pub writer_tenant: Arc<str>,
    /// Hit: prompt tokens the request took from the cache (all its hit pages); else 0.
    pub hit_tokens: u32,
}

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

/// Rows of `rdma_ops`, column by column: what the eBPF witness's collector hands the writer per
/// ring-buffer drain. The witness writes at the transfer path's rate (5 rows per KV page), so its
/// rows skip the per-event path (an `Event` allocated, matched and freed per row, appended to
/// generic column builders): the collector appends straight into these columns and the writer
/// wraps them as one Arrow record batch without copying (`schema::rdma_ops_batch`).
///
/// Invariant: every column has [`RdmaOpRows::len`] entries (checked by `push`'s construction and
/// asserted where the batch is built).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RdmaOpRows {
    pub ts_ns: Vec<MonoNs>,
    pub ktime_ns: Vec<u64>,
    pub pid: Vec<u32>,
    pub tid: Vec<u32>,
    pub op: Vec<&'static str>,
    pub ctx: Vec<u64>,
    pub wr_id: Vec<u64>,
    pub chain_index: Vec<u32>,
    pub opcode: Vec<u32>,
    pub flags: Vec<u32>,
    pub imm: Vec<u32>,
    pub remote_addr: Vec<u64>,
    pub rkey: Vec<u32>,
    pub num_sge: Vec<u32>,
    pub bytes: Vec<u64>,
    pub status: Vec<i32>,
    pub qp_num: Vec<u32>,
    pub sges: Vec<Option<String>>,
    pub probe_flags: Vec<Option<String>>,
}

impl RdmaOpRows {
    pub fn with_capacity(n: usize) -> Self {
        Self {
            ts_ns: Vec::with_capacity(n),
            ktime_ns: Vec::with_capacity(n),
            pid: Vec::with_capacity(n),
            tid: Vec::with_capacity(n),
            op: Vec::with_capacity(n),
            ctx: Vec::with_capacity(n),
            wr_id: Vec::with_capacity(n),
            chain_index: Vec::with_capacity(n),
            opcode: Vec::with_capacity(n),
            flags: Vec::with_capacity(n),
            imm: Vec::with_capacity(n),
            remote_addr: Vec::with_capacity(n),
            rkey: Vec::with_capacity(n),
            num_sge: Vec::with_capacity(n),
            bytes: Vec::with_capacity(n),
            status: Vec::with_capacity(n),
            qp_num: Vec::with_capacity(n),
            sges: Vec::with_capacity(n),
            probe_flags: Vec::with_capacity(n),
        }
    }

    pub fn len(&self) -> usize {
        self.ts_ns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ts_ns.is_empty()
    }

    /// True when every column has the same number of entries.
    pub fn is_rectangular(&self) -> bool {
        let n = self.len();
        [
            self.ktime_ns.len(),
            self.pid.len(),
            self.tid.len(),
            self.op.len(),
            self.ctx.len(),
            self.wr_id.len(),
            self.chain_index.len(),
            self.opcode.len(),
            self.flags.len(),
            self.imm.len(),
            self.remote_addr.len(),
            self.rkey.len(),
            self.num_sge.len(),
            self.bytes.len(),
            self.status.len(),
            self.qp_num.len(),
            self.sges.len(),
            self.probe_flags.len(),
        ]
        .iter()
        .all(|&l| l == n)
    }

    pub fn push(&mut self, o: RdmaOp) {
        self.ts_ns.push(o.ts_ns);
        self.ktime_ns.push(o.ktime_ns);
        self.pid.push(o.pid);
        self.tid.push(o.tid);
        self.op.push(o.op);
        self.ctx.push(o.ctx);
        self.wr_id.push(o.wr_id);
        self.chain_index.push(o.chain_index);
        self.opcode.push(o.opcode);
        self.flags.push(o.flags);
        self.imm.push(o.imm);
        self.remote_addr.push(o.remote_addr);
        self.rkey.push(o.rkey);
        self.num_sge.push(o.num_sge);
        self.bytes.push(o.bytes);
        self.status.push(o.status);
        self.qp_num.push(o.qp_num);
        self.sges.push(o.sges);
        self.probe_flags.push(o.probe_flags);
        debug_assert!(self.is_rectangular());
    }

    /// Row `i` as an event (for sinks that take events one by one).
    pub fn row(&self, i: usize) -> RdmaOp {
        RdmaOp {
            ts_ns: self.ts_ns[i],
            ktime_ns: self.ktime_ns[i],
            pid: self.pid[i],
            tid: self.tid[i],
            op: self.op[i],
            ctx: self.ctx[i],
            wr_id: self.wr_id[i],
            chain_index: self.chain_index[i],
            opcode: self.opcode[i],
            flags: self.flags[i],
            imm: self.imm[i],
            remote_addr: self.remote_addr[i],
            rkey: self.rkey[i],
            num_sge: self.num_sge[i],
            bytes: self.bytes[i],
            status: self.status[i],
            qp_num: self.qp_num[i],
            sges: self.sges[i].clone(),
            probe_flags: self.probe_flags[i].clone(),
        }
    }

    fn into_events(self) -> Vec<Event> {
        assert!(self.is_rectangular(), "rdma_ops columns of unequal length");
        (0..self.len())
            .map(|i| Event::RdmaOp(Box::new(self.row(i))))
            .collect()
    }
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

    /// Record witness rows (`rdma_ops`), in order: the same as [`AuditSink::record_all`] on
    /// [`RdmaOpRows::into_events`], without the per-row events where the sink can (the writer).
    fn record_rdma_ops(&self, rows: RdmaOpRows) -> Result<(), SinkError> {
        self.record_all(rows.into_events())
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

    fn record_rdma_ops(&self, rows: RdmaOpRows) -> Result<(), SinkError> {
        self.count.fetch_add(rows.len() as u64, Ordering::Relaxed);
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

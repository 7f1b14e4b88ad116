//! The append-only audit writer.
//!
//! ```text
//! record() ─► bounded queue ─► writer thread ─► column builders ─► record batch
//!    (blocks when full: fail-closed)             every `batch_rows` or `flush_interval`
//!                                                     │
//!                       live segment: Arrow IPC stream per table, `_live/node=<id>/`
//!                       (readable up to its last complete message after a crash; fsync policy)
//!                                                     │ rotation (size or age, or shutdown)
//!                       sealed: `<table>/node=<id>/date=<YYYY-MM-DD>/<segment>.parquet` (zstd)
//!                       written to a temporary name, fsynced, renamed, directory fsynced
//!                                                     │
//!                       digest: `_digests/node=<id>/<n>.json`, Ed25519-signed, chained
//! ```
//! On start an unsealed live segment is recovered (every complete message) and sealed before
//! anything new is written: nothing that reached the segment is lost.
//!
//! Sequence numbers: the writer assigns `seq` per node, over all tables, in arrival order;
//! `next_seq` resumes after recovery from the highest sealed `seq`.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::RecordBatch;
use ed25519_dalek::SigningKey;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;

use crate::checkpoint::{Checkpoint, CheckpointSink, DirSink};
use crate::digest::{self, DigestFile, SealedFile, TreeHead};
use crate::leaf;
use crate::promise::{Promise, PromisedLeaf};
use crate::request_index::{LeafRef, RequestIndex, RequestLeaves, RequestSpans, SpanLookup};
use crate::schema::{self, SCHEMA_VERSION, SCHEMA_VERSION_KEY, Table, TableBuilder};
use crate::tlog::{self, EdgeTree, NoteSigner};
use crate::tree_store::{self, TreeDir};
use crate::{AuditSink, Event, RdmaOpRows, SinkError, mono_now_ns, thread_cpu_ns};
use tlog_tiles::Hash;

#[derive(Debug, thiserror::Error)]
pub enum WriterError {
    #[error("audit I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    #[error("digest chain: {0}")]
    Digest(#[from] digest::DigestError),
    #[error(transparent)]
    Tree(#[from] crate::tree_store::TreeStoreError),
    #[error("a receipt promise: {0}")]
    Promise(String),
    #[error("unrecognised live file {}", .0.display())]
    UnknownLiveFile(PathBuf),
    #[error("audit writer is closed: {0}")]
    Closed(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> WriterError + '_ {
    move |source| WriterError::Io {
        path: path.to_owned(),
        source,
    }
}

/// When the live segment is fsynced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// After every batch written to the live segment (acknowledged = on disk).
    EveryBatch,
    /// At most this often.
    Interval(Duration),
    /// Only at rotation (sealing always fsyncs).
    Never,
}

/// What `record` does when the queue is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backpressure {
    /// Wait for space (admission pauses). The default: never lose an event.
    Block,
    /// Drop the event, count it, and record the count in `writer_events` and in metrics.
    AllowDrop,
}

#[derive(Clone, Debug)]
pub struct WriterConfig {
    pub root: PathBuf,
    pub node: u32,
    /// Events the queue holds before `record` waits (or drops, in `AllowDrop`).
    pub queue_capacity: usize,
    /// Rows per record batch.
    pub batch_rows: usize,
    /// A partial batch is written after this long.
    pub flush_interval: Duration,
    pub fsync: FsyncPolicy,
    /// Seal the live segment when it reaches this many bytes…
    pub rotate_bytes: u64,
    /// …or this age.
    pub rotate_interval: Duration,
    pub backpressure: Backpressure,
    pub signing_key: SigningKey,
    /// Signed checkpoints of the chain ([`crate::checkpoint`]) are issued at start, after every
    /// seal, at close, and at least this often in between — idle or not.
    pub checkpoint_interval: Duration,
    /// Where checkpoints go besides the root's own copy (`<root>/_checkpoints/`, which whoever
    /// controls this disk can delete): other disks, other nodes' logs, stdout, an object store.
    /// Published by a thread of their own, so a slow place never stalls the log. Never this
    /// writer's own log (a `LogSink` over it).
    pub checkpoint_sinks: Vec<Arc<dyn CheckpointSink>>,
    /// The transparency log's origin: the first line of its checkpoints and the name of the
    /// node's note key (`None`: [`crate::tree_store::default_origin`]).
    pub origin: Option<String>,
    /// Also write the tree's full level-0 tiles (one file per 256 records, 32 bytes a record)
    /// at every seal. Off by default: they are the leaves' hashes, recomputable from the sealed
    /// records (`custody audit tiles`), and writing them cost the writer ~1.5–3 µs per event on
    /// this host's disk (a file created per 256 events); the levels above and every partial tile
    /// are always written.
    pub level0_tiles: bool,
}

impl WriterConfig {
    pub fn new(root: impl Into<PathBuf>, node: u32, signing_key: SigningKey) -> Self {
        Self {
            root: root.into(),
            node,
            queue_capacity: 1 << 16,
            batch_rows: 8192,
            flush_interval: Duration::from_millis(50),
            fsync: FsyncPolicy::EveryBatch,
            rotate_bytes: 64 << 20,
            rotate_interval: Duration::from_secs(300),
            backpressure: Backpressure::Block,
            signing_key,
            checkpoint_interval: Duration::from_secs(60),
            checkpoint_sinks: Vec::new(),
            origin: None,
            level0_tiles: false,
        }
    }
}

/// Whether a checkpoint may be skipped when the publisher is behind (an interval's, a seal's)
/// or must wait for room (the first and the last).
#[derive(Clone, Copy, Debug)]
enum Urgency {
    Wait,
    Skippable,
}

enum Msg {
    Event(Event),
    /// Several events, in order (`record_all`); counted in events against the queue's bound.
    Events(Vec<Event>),
    /// Witness rows, column by column (`record_rdma_ops`); counted in rows.
    RdmaOps(Box<RdmaOpRows>),
    /// Write and fsync everything received so far; reply with the highest durable seq (+1).
    Sync(SyncSender<Result<u64, WriterError>>),
    /// Seal the live segment now.
    Rotate(SyncSender<Result<(), WriterError>>),
    /// Write what was received so far (no fsync) and take a request's leaves from the index.
    RequestLeaves(u64, SyncSender<Result<RequestLeaves, WriterError>>),
    /// Write what was received so far (no fsync) and say where a request's records are.
    RequestSpan(u64, SyncSender<Result<SpanLookup, WriterError>>),
    Shutdown,
}

/// Leaves the request index holds at most (~48 B each): about a million, ~50 MB, the records of
/// thousands of recent requests, each taken by its response moments after it ends.
const REQUEST_INDEX_LEAVES: usize = 1 << 20;
/// Requests whose span of seqs the writer keeps (~40 B each): a receipt of any of the most
/// recent quarter million reads only the segments it spans.
const REQUEST_SPANS: usize = 1 << 18;

/// A response's receipt promise, as [`AuditWriter::receipt_promise`] makes it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromiseReply {
    /// Every record of the ended request, signed (`note`) by the node's note key.
    Signed { promise: Promise, note: Vec<u8> },
    /// The request has not ended (its end record is not in the log yet): no promise of part.
    Running,
    /// Some of its records were not indexed (the index was full): no promise of part.
    Incomplete,
    /// No records of it in the index (never seen, evicted, or already promised).
    Unknown,
}

/// Handle to the writer thread. `record` is the hot path.
#[derive(Debug)]
pub struct AuditWriter {
    tx: SyncSender<Msg>,
    backpressure: Backpressure,
    dropped: Arc<AtomicU64>,
    failure: Arc<Mutex<Option<String>>>,
    handle: Mutex<Option<JoinHandle<()>>>,
    /// CPU time the writer thread used, ns (set when it stops; for the per-core benchmark).
    cpu_ns: Arc<AtomicU64>,
    /// Of the writer thread's time, what the Merkle tree took (ns, wall).
    tree_ns: Arc<AtomicU64>,
    /// Events accepted into the queue, and events the writer thread took out of it: their
    /// difference is the queue depth (a server refuses new work before the queue is full).
    enqueued: AtomicU64,
    dequeued: Arc<AtomicU64>,
    queue_capacity: usize,
    /// The checkpoint publisher (joined after the writer thread, which hands it the last one).
    publisher: Mutex<Option<JoinHandle<()>>>,
    checkpoint_failures: Arc<AtomicU64>,
    /// The writer thread, woken (from its idle nap) by a caller that waits for its reply.
    thread: std::thread::Thread,
    /// CPU time of the leaf hasher's thread, ns.
    hasher_cpu_ns: Arc<AtomicU64>,
    /// The node's note key (the checkpoints' signer), for receipt promises.
    note_signer: NoteSigner,
    node: u32,
}

/// Checkpoints waiting for the publisher: a few; when full, an interval's checkpoint is skipped
/// (a newer one follows) and the final one waits.
const CHECKPOINT_QUEUE: usize = 4;

/// The publisher thread: each checkpoint to the root's own copy, then to every sink. A failure
/// is logged and counted; the log goes on (the checkpoint's absence is what a verifier sees).
fn publish_checkpoints(
    rx: Receiver<Checkpoint>,
    root: PathBuf,
    sinks: Vec<Arc<dyn CheckpointSink>>,
    failures: &AtomicU64,
) {
    let local = DirSink::new(root.join(LOCAL_CHECKPOINTS));
    while let Ok(cp) = rx.recv() {
        let places =
            std::iter::once(&local as &dyn CheckpointSink).chain(sinks.iter().map(|s| s.as_ref()));
        for place in places {
            if let Err(e) = place.publish(&cp) {
                failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, node = cp.body.node, "checkpoint not published");
            }
        }
    }
}

/// The root's own copy of its newest checkpoints (`<root>/_checkpoints/node=<id>.json`).
pub const LOCAL_CHECKPOINTS: &str = "_checkpoints";

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Msg::Event(_) => "Event",
            Msg::Events(_) => "Events",
            Msg::RdmaOps(_) => "RdmaOps",
            Msg::Sync(_) => "Sync",
            Msg::Rotate(_) => "Rotate",
            Msg::RequestLeaves(..) => "RequestLeaves",
            Msg::RequestSpan(..) => "RequestSpan",
            Msg::Shutdown => "Shutdown",
        })
    }
}

impl AuditWriter {
    /// Recover and seal any live segment left by a previous run, then start the writer thread.
    pub fn open(cfg: WriterConfig) -> Result<Self, WriterError> {
        assert!(cfg.queue_capacity > 0 && cfg.batch_rows > 0);
        let mut st = State::open(cfg.clone())?;
        let tree_ns = st.tree_ns.clone();
        let hasher_cpu_ns = st.hasher.cpu_ns.clone();
        let note_signer = st.note_signer.clone();
        let checkpoint_failures = Arc::new(AtomicU64::new(0));
        let (cp_tx, cp_rx) = mpsc::sync_channel(CHECKPOINT_QUEUE);
        let (root, sinks, fails) = (
            cfg.root.clone(),
            cfg.checkpoint_sinks.clone(),
            checkpoint_failures.clone(),
        );
        let publisher = std::thread::Builder::new()
            .name(format!("audit-checkpoints-{}", cfg.node))
            .spawn(move || publish_checkpoints(cp_rx, root, sinks, &fails))
            .map_err(|e| WriterError::Closed(e.to_string()))?;
        st.publisher = Some(cp_tx);
        let (tx, rx) = mpsc::sync_channel(cfg.queue_capacity);
        let dropped = Arc::new(AtomicU64::new(0));
        let failure = Arc::new(Mutex::new(None));
        let (d, f) = (dropped.clone(), failure.clone());
        let cpu_ns = Arc::new(AtomicU64::new(0));
        let cpu = cpu_ns.clone();
        let dequeued = Arc::new(AtomicU64::new(0));
        let deq = dequeued.clone();
        let handle = std::thread::Builder::new()
            .name(format!("audit-writer-{}", cfg.node))
            .spawn(move || {
                let r = st.run(rx, &d, &cpu, &deq);
                cpu.store(thread_cpu_ns(), Ordering::Relaxed);
                if let Err(e) = r {
                    tracing::error!(error = %e, "audit writer stopped: the engine must stop serving");
                    if let Ok(mut g) = f.lock() {
                        *g = Some(e.to_string());
                    }
                }
            })
            .map_err(|e| WriterError::Closed(e.to_string()))?;
        let thread = handle.thread().clone();
        Ok(Self {
            thread,
            hasher_cpu_ns,
            note_signer,
            node: cfg.node,
            tx,
            backpressure: cfg.backpressure,
            dropped,
            failure,
            handle: Mutex::new(Some(handle)),
            cpu_ns,
            tree_ns,
            enqueued: AtomicU64::new(0),
            dequeued,
            queue_capacity: cfg.queue_capacity,
            publisher: Mutex::new(Some(publisher)),
            checkpoint_failures,
        })
    }

    /// Checkpoints that a place refused (each logged at ERROR).
    pub fn checkpoint_failures(&self) -> u64 {
        self.checkpoint_failures.load(Ordering::Relaxed)
    }

    fn closed(&self) -> String {
        self.failure
            .lock()
            .ok()
            .and_then(|g| g.clone())
            .unwrap_or_else(|| "writer thread has stopped".to_owned())
    }

    /// Everything recorded so far is written and fsynced; returns the number of events durable on
    /// this node (the next seq).
    pub fn sync(&self) -> Result<u64, WriterError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.ask(Msg::Sync(tx))?;
        rx.recv().map_err(|_| WriterError::Closed(self.closed()))?
    }

    /// Sends a message whose reply the caller waits for, and wakes the writer for it.
    fn ask(&self, msg: Msg) -> Result<(), WriterError> {
        self.tx
            .send(msg)
            .map_err(|_| WriterError::Closed(self.closed()))?;
        self.thread.unpark();
        Ok(())
    }

    /// The node's signed promise of every record of `request` (issue 40), for its response:
    /// the writer writes what it has received (so every event recorded before this call is in),
    /// takes the request's leaves from its index (once: an ended request is promised once), and
    /// the promise is signed here, on the caller's thread. `tenant`: the request's own (the
    /// caller's: a server asks for the request it answers).
    pub fn receipt_promise(&self, tenant: &str, request: u64) -> Result<PromiseReply, WriterError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.ask(Msg::RequestLeaves(request, tx))?;
        let leaves = match rx
            .recv()
            .map_err(|_| WriterError::Closed(self.closed()))??
        {
            RequestLeaves::Found { ended: false, .. } => return Ok(PromiseReply::Running),
            RequestLeaves::Incomplete => return Ok(PromiseReply::Incomplete),
            RequestLeaves::Unknown => return Ok(PromiseReply::Unknown),
            RequestLeaves::Found { leaves, .. } => leaves,
        };
        let promise = Promise {
            origin: self.note_signer_name().to_owned(),
            request_id: format!("req-{}-{request}", self.node),
            tenant: tenant.to_owned(),
            leaves: leaves
                .into_iter()
                .map(|l| PromisedLeaf {
                    seq: l.seq,
                    table: l.table.to_owned(),
                    leaf: l.leaf,
                })
                .collect(),
        };
        let note = promise
            .sign(&self.note_signer)
            .map_err(|e| WriterError::Promise(e.to_string()))?;
        Ok(PromiseReply::Signed { promise, note })
    }

    /// Where `request`'s records are in this incarnation's log (the rows received so far
    /// written first, without fsync): what a receipt lookup reads instead of scanning.
    pub fn request_span(&self, request: u64) -> Result<SpanLookup, WriterError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.ask(Msg::RequestSpan(request, tx))?;
        rx.recv().map_err(|_| WriterError::Closed(self.closed()))?
    }

    fn note_signer_name(&self) -> &str {
        signed_note::Signer::name(&self.note_signer)
    }

    /// Seal the live segment now (Parquet + digest).
    pub fn rotate(&self) -> Result<(), WriterError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.ask(Msg::Rotate(tx))?;
        rx.recv().map_err(|_| WriterError::Closed(self.closed()))?
    }

    /// CPU time of the writer thread in ns as of the last [`AuditWriter::sync`] or, after
    /// [`AuditWriter::close`], in total (0 before either, or where `/proc/thread-self/schedstat`
    /// is unavailable).
    pub fn tree_ns(&self) -> u64 {
        self.tree_ns.load(Ordering::Relaxed)
    }

    /// CPU time the leaf hasher's thread used so far, ns (the tree's hashing, off the writer's
    /// thread).
    pub fn hasher_cpu_ns(&self) -> u64 {
        self.hasher_cpu_ns.load(Ordering::Relaxed)
    }

    /// CPU time the writer thread used so far, ns.
    pub fn writer_cpu_ns(&self) -> u64 {
        self.cpu_ns.load(Ordering::Relaxed)
    }

    /// Events dropped so far (only in `AllowDrop` mode; always 0 otherwise).
    pub fn dropped_total(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Events queued and not yet taken by the writer thread (approximate while both move).
    pub fn queue_depth(&self) -> u64 {
        let deq = self.dequeued.load(Ordering::Relaxed);
        self.enqueued.load(Ordering::Relaxed).saturating_sub(deq)
    }

    /// Events the queue holds before `record` waits (or drops).
    pub fn queue_capacity(&self) -> usize {
        self.queue_capacity
    }

    /// Seal everything and stop the thread.
    pub fn close(&self) -> Result<(), WriterError> {
        let _ = self.tx.send(Msg::Shutdown);
        if let Some(h) = self.handle.lock().ok().and_then(|mut g| g.take()) {
            let _ = h.join();
        }
        // The writer thread handed over its last checkpoint and dropped its end: the publisher
        // finishes the queue and stops.
        if let Some(h) = self.publisher.lock().ok().and_then(|mut g| g.take()) {
            let _ = h.join();
        }
        match self.failure.lock().ok().and_then(|g| g.clone()) {
            Some(e) => Err(WriterError::Closed(e)),
            None => Ok(()),
        }
    }
}

impl Drop for AuditWriter {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

impl AuditSink for AuditWriter {
    fn record(&self, event: Event) -> Result<(), SinkError> {
        match self.backpressure {
            Backpressure::Block => {
                self.tx
                    .send(Msg::Event(event))
                    .map_err(|_| SinkError::Closed(self.closed()))?;
                self.enqueued.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Backpressure::AllowDrop => match self.tx.try_send(Msg::Event(event)) {
                Ok(()) => {
                    self.enqueued.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
                Err(TrySendError::Full(_)) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
                Err(TrySendError::Disconnected(_)) => Err(SinkError::Closed(self.closed())),
            },
        }
    }

    fn record_all(&self, events: Vec<Event>) -> Result<(), SinkError> {
        let n = events.len() as u64;
        self.hand_off(n, Msg::Events(events))
    }

    fn record_rdma_ops(&self, rows: RdmaOpRows) -> Result<(), SinkError> {
        assert!(rows.is_rectangular(), "rdma_ops columns of unequal length");
        let n = rows.len() as u64;
        self.hand_off(n, Msg::RdmaOps(Box::new(rows)))
    }
}

impl AuditWriter {
    /// Hand `msg`, worth `n` events, to the writer thread in one queue message. The queue's
    /// bound is in events: a batch is handed off only when it fits (or when the queue is empty:
    /// a batch larger than the whole queue goes alone).
    fn hand_off(&self, n: u64, msg: Msg) -> Result<(), SinkError> {
        if n == 0 {
            return Ok(());
        }
        let cap = self.queue_capacity as u64;
        let fits = |w: &Self| {
            let depth = w.queue_depth();
            depth == 0 || depth + n <= cap
        };
        match self.backpressure {
            Backpressure::Block => {
                let mut nap = Duration::from_micros(50);
                while !fits(self) {
                    let stopped = self
                        .handle
                        .lock()
                        .map(|h| h.as_ref().is_none_or(|j| j.is_finished()))
                        .unwrap_or(true);
                    if stopped {
                        return Err(SinkError::Closed(self.closed()));
                    }
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(Duration::from_millis(5));
                }
                self.tx
                    .send(msg)
                    .map_err(|_| SinkError::Closed(self.closed()))?;
                self.enqueued.fetch_add(n, Ordering::Relaxed);
                Ok(())
            }
            Backpressure::AllowDrop => {
                if !fits(self) {
                    self.dropped.fetch_add(n, Ordering::Relaxed);
                    return Ok(());
                }
                match self.tx.try_send(msg) {
                    Ok(()) => {
                        self.enqueued.fetch_add(n, Ordering::Relaxed);
                        Ok(())
                    }
                    Err(TrySendError::Full(_)) => {
                        self.dropped.fetch_add(n, Ordering::Relaxed);
                        Ok(())
                    }
                    Err(TrySendError::Disconnected(_)) => Err(SinkError::Closed(self.closed())),
                }
            }
        }
    }
}

/// One table's live IPC stream.
struct Live {
    path: PathBuf,
    writer: StreamWriter<BufWriter<File>>,
}

struct State {
    cfg: WriterConfig,
    builders: BTreeMap<Table, TableBuilder>,
    /// Record batches not yet written to the live segment, in seq order, ahead of their table's
    /// builder rows (rows that arrived as columns: `Msg::RdmaOps`).
    batches: BTreeMap<Table, Vec<RecordBatch>>,
    live: BTreeMap<Table, Live>,
    next_seq: u64,
    /// First seq of the live segment.
    segment_seq_start: u64,
    segment: u64,
    segment_started: Instant,
    live_bytes: u64,
    last_fsync: Instant,
    /// A live file was created since the live directory was last fsynced.
    live_dir_dirty: bool,
    pending_rows: usize,
    anchor_mono: u64,
    anchor_wall: i64,
    chain: digest::ChainHead,
    /// To the checkpoint publisher (set once the thread runs).
    publisher: Option<SyncSender<Checkpoint>>,
    last_checkpoint: Instant,
    /// The Merkle tree over the sealed records (its right edge; tiles on disk).
    tree: EdgeTree,
    tree_dir: TreeDir,
    note_signer: NoteSigner,
    /// Time the tree took, ns: leaves, hashing, tiles and notes written (the benchmark's).
    tree_ns: Arc<AtomicU64>,
    /// The live segment's leaves, hashed as its rows are flushed (the seal takes them).
    live_leaves: leaf::SegmentLeaves,
    /// Hashes flushed batches' leaves on a thread of its own.
    hasher: LeafHasher,
    /// Recent requests' leaves, for their responses' receipt promises.
    requests: RequestIndex,
    /// Recent requests' spans of seqs, for receipt lookups.
    spans: RequestSpans,
}

/// A complete live file's record batches, for sealing: the file read in one call and decoded
/// in place (the batches' columns are slices of that one buffer). A file reader allocates and
/// zero-fills every column anew: reading back was about a third of sealing the eBPF witness's
/// rows in context, much of it page faults on fresh memory (5–8 % less sealing CPU hot).
fn read_live(path: &Path) -> Result<Vec<RecordBatch>, WriterError> {
    let bytes = fs::read(path).map_err(io(path))?;
    let mut buf = arrow::buffer::Buffer::from_vec(bytes);
    let mut dec = arrow::ipc::reader::StreamDecoder::new();
    let mut out = Vec::new();
    // Each round consumes at least one message, or the file is malformed: bounded by its length.
    while !buf.is_empty() {
        let before = buf.len();
        if let Some(b) = dec.decode(&mut buf)? {
            out.push(b);
        } else if buf.len() == before {
            return Err(WriterError::Arrow(arrow::error::ArrowError::IpcError(
                format!(
                    "live file {} does not decode as an Arrow IPC stream",
                    path.display()
                ),
            )));
        }
    }
    dec.finish()?;
    Ok(out)
}

fn live_dir(root: &Path, node: u32) -> PathBuf {
    root.join("_live").join(format!("node={node}"))
}

fn fsync_dir(dir: &Path) -> Result<(), WriterError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// `YYYY-MM-DD` (UTC) of a Unix time in nanoseconds (civil-from-days, proleptic Gregorian).
fn utc_date(wall_ns: i64) -> String {
    let days = wall_ns.div_euclid(86_400_000_000_000);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    format!("{:04}-{:02}-{:02}", if m <= 2 { y + 1 } else { y }, m, d)
}

impl State {
    fn open(cfg: WriterConfig) -> Result<Self, WriterError> {
        fs::create_dir_all(live_dir(&cfg.root, cfg.node)).map_err(io(&cfg.root))?;
        let chain = digest::ChainHead::load(&cfg.root, cfg.node).map_err(WriterError::Digest)?;
        let tree = tree_store::open_tree(&cfg.root, cfg.node, &chain)?;
        let origin = cfg.origin.clone().unwrap_or_else(|| {
            tree_store::default_origin(cfg.node, &cfg.signing_key.verifying_key())
        });
        let note_signer = NoteSigner::new(&origin, cfg.signing_key.clone())
            .map_err(|e| WriterError::Tree(e.into()))?;
        let anchor_mono = mono_now_ns();
        let anchor_wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        let chain_next_seq = chain.next_seq;
        let tree_ns = Arc::new(AtomicU64::new(0));
        let hasher = LeafHasher::start(cfg.node, tree_ns.clone())?;
        let mut st = Self {
            next_seq: chain.next_seq,
            segment_seq_start: chain.next_seq,
            segment: chain.next_segment,
            builders: Table::ALL
                .into_iter()
                .map(|t| (t, TableBuilder::new(t)))
                .collect(),
            batches: BTreeMap::new(),
            live: BTreeMap::new(),
            segment_started: Instant::now(),
            live_bytes: 0,
            last_fsync: Instant::now(),
            live_dir_dirty: false,
            pending_rows: 0,
            anchor_mono,
            anchor_wall,
            chain,
            publisher: None,
            last_checkpoint: Instant::now(),
            tree,
            tree_dir: TreeDir::new(&cfg.root, cfg.node),
            note_signer,
            tree_ns,
            live_leaves: leaf::SegmentLeaves::new(cfg.node, chain_next_seq),
            hasher,
            requests: RequestIndex::new(REQUEST_INDEX_LEAVES),
            spans: RequestSpans::new(REQUEST_SPANS),
            cfg,
        };
        st.recover()?;
        // The newest tree's note again: a crash between a digest and its note leaves the note
        // one seal behind; this makes it current before anything new is written.
        if st.tree.size() > 0 {
            st.write_note()?;
        }
        Ok(st)
    }

    fn wall(&self, ts: u64) -> i64 {
        self.anchor_wall + (ts as i64 - self.anchor_mono as i64)
    }

    /// Seal whatever a previous run left in the live directory (every complete IPC message).
    fn recover(&mut self) -> Result<(), WriterError> {
        let dir = live_dir(&self.cfg.root, self.cfg.node);
        let mut files: Vec<PathBuf> = fs::read_dir(&dir)
            .map_err(io(&dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "arrows"))
            .collect();
        if files.is_empty() {
            return Ok(());
        }
        files.sort();
        let mut recovered: BTreeMap<Table, Vec<RecordBatch>> = BTreeMap::new();
        let mut max_seq: Option<u64> = None;
        let mut min_seq: Option<u64> = None;
        for f in &files {
            let table = f
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.split_once('-'))
                .and_then(|(_, t)| Table::from_name(t))
                .ok_or_else(|| WriterError::UnknownLiveFile(f.clone()))?;
            let Ok(reader) = File::open(f)
                .map_err(io(f))
                .and_then(|fh| Ok(StreamReader::try_new(fh, None)?))
            else {
                tracing::warn!(file = %f.display(), "live segment has no complete schema message; nothing to recover");
                continue;
            };
            for batch in reader {
                // A torn final message ends recovery of this file: everything before it is kept.
                let Ok(batch) = batch else { break };
                if let Some(seq) = batch
                    .column(1)
                    .as_any()
                    .downcast_ref::<arrow::array::UInt64Array>()
                {
                    for v in seq.values().iter() {
                        max_seq = Some(max_seq.map_or(*v, |m: u64| m.max(*v)));
                        min_seq = Some(min_seq.map_or(*v, |m: u64| m.min(*v)));
                    }
                }
                recovered.entry(table).or_default().push(batch);
            }
        }
        let rows: usize = recovered
            .values()
            .flatten()
            .map(RecordBatch::num_rows)
            .sum();
        tracing::warn!(
            files = files.len(),
            rows,
            "recovering unsealed audit live segment"
        );
        if let Some(m) = max_seq {
            self.segment_seq_start = min_seq.unwrap_or(self.next_seq).min(self.next_seq);
            self.next_seq = self.next_seq.max(m + 1);
        }
        self.seal(recovered)?;
        for f in &files {
            fs::remove_file(f).map_err(io(f))?;
        }
        fsync_dir(&dir)
    }

    fn run(
        &mut self,
        rx: Receiver<Msg>,
        dropped: &AtomicU64,
        cpu_ns: &AtomicU64,
        dequeued: &AtomicU64,
    ) -> Result<(), WriterError> {
        // Polling, not blocking: while the queue has room, a producer's `record` never has to
        // wake this thread (no syscall on the hot path). An idle writer naps, backing off from
        // 1 ms to 20 ms so that it does not steal the compute threads' cores with wake-ups; the
        // queue (`queue_capacity` events) absorbs what arrives meanwhile (1 ms at 2 M events/s
        // is 2 000 events, 3 % of the default queue). Measured (`custody bench --audit-cost`):
        // the timer wake-ups were about half of the writer's CPU with a 100 µs first nap, as an
        // engine emits a few events per step, every step, and each step restarted the backoff.
        const NAP_MIN: Duration = Duration::from_millis(1);
        const NAP_MAX: Duration = Duration::from_millis(20);
        let mut nap = NAP_MIN;
        let mut reported_drops = 0u64;
        let mut last_flush = Instant::now();
        // A checkpoint at start: a node that never seals still says where its chain stands.
        self.checkpoint(Urgency::Wait);
        loop {
            let msg = rx.try_recv();
            if msg.is_ok() {
                nap = NAP_MIN;
            }
            match msg {
                Ok(Msg::Event(ev)) => {
                    dequeued.fetch_add(1, Ordering::Relaxed);
                    self.push(&ev);
                    if self.pending_rows >= self.cfg.batch_rows {
                        self.flush_batch(false)?;
                        last_flush = Instant::now();
                        self.maybe_rotate()?;
                    }
                }
                Ok(Msg::Events(evs)) => {
                    dequeued.fetch_add(evs.len() as u64, Ordering::Relaxed);
                    for ev in &evs {
                        self.push(ev);
                        if self.pending_rows >= self.cfg.batch_rows {
                            self.flush_batch(false)?;
                            last_flush = Instant::now();
                            self.maybe_rotate()?;
                        }
                    }
                }
                Ok(Msg::RdmaOps(rows)) => {
                    dequeued.fetch_add(rows.len() as u64, Ordering::Relaxed);
                    self.push_rdma_ops(*rows);
                    if self.pending_rows >= self.cfg.batch_rows {
                        self.flush_batch(false)?;
                        last_flush = Instant::now();
                        self.maybe_rotate()?;
                    }
                }
                Ok(Msg::Sync(reply)) => {
                    let r = self.flush_batch(true).map(|()| self.next_seq);
                    // CPU so far, readable after `sync` returns (steady-state cost, before sealing).
                    cpu_ns.store(thread_cpu_ns(), Ordering::Relaxed);
                    // The error goes on below (it stops the writer); the caller hears it as the reason.
                    let _ = reply.send(
                        r.as_ref()
                            .map(|v| *v)
                            .map_err(|e| WriterError::Closed(e.to_string())),
                    );
                    r?;
                    last_flush = Instant::now();
                }
                Ok(Msg::RequestLeaves(request, reply)) => {
                    self.look_up(&reply, |st| st.requests.take(request))?;
                    last_flush = Instant::now();
                }
                Ok(Msg::RequestSpan(request, reply)) => {
                    self.look_up(&reply, |st| st.spans.lookup(request))?;
                    last_flush = Instant::now();
                }
                Ok(Msg::Rotate(reply)) => {
                    let r = self.rotate();
                    let _ = reply.send(
                        r.as_ref()
                            .map(|_| ())
                            .map_err(|e| WriterError::Closed(e.to_string())),
                    );
                    r?;
                }
                Ok(Msg::Shutdown) | Err(TryRecvError::Disconnected) => {
                    // Drain what is queued, then seal.
                    while let Ok(m) = rx.try_recv() {
                        match m {
                            Msg::Event(ev) => self.push(&ev),
                            Msg::Events(evs) => evs.iter().for_each(|ev| self.push(ev)),
                            Msg::RdmaOps(rows) => self.push_rdma_ops(*rows),
                            _ => {}
                        }
                    }
                    self.record_drops(dropped, &mut reported_drops);
                    let r = self.rotate();
                    self.checkpoint(Urgency::Wait);
                    return r;
                }
                Err(TryRecvError::Empty) => {
                    self.record_drops(dropped, &mut reported_drops);
                    if self.pending_rows > 0 && last_flush.elapsed() >= self.cfg.flush_interval {
                        self.flush_batch(false)?;
                        last_flush = Instant::now();
                    }
                    self.maybe_rotate()?;
                    // Woken early by a caller waiting for a reply (`AuditWriter::ask`).
                    std::thread::park_timeout(nap);
                    nap = (nap * 2).min(NAP_MAX);
                }
            }
        }
    }

    fn maybe_rotate(&mut self) -> Result<(), WriterError> {
        if self.live_bytes >= self.cfg.rotate_bytes
            || (self.live_bytes > 0 && self.segment_started.elapsed() >= self.cfg.rotate_interval)
        {
            self.rotate()?;
        }
        if self.last_checkpoint.elapsed() >= self.cfg.checkpoint_interval {
            self.checkpoint(Urgency::Skippable);
        }
        Ok(())
    }

    /// Sign where the chain stands now and hand it to the publisher.
    fn checkpoint(&mut self, urgency: Urgency) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        let cp = Checkpoint::sign(&self.chain, self.cfg.node, now, &self.cfg.signing_key);
        self.last_checkpoint = Instant::now();
        let Some(tx) = &self.publisher else { return };
        match urgency {
            Urgency::Wait => {
                let _ = tx.send(cp);
            }
            Urgency::Skippable => {
                if let Err(TrySendError::Full(_)) = tx.try_send(cp) {
                    tracing::warn!(
                        node = self.cfg.node,
                        "checkpoint publisher behind: an interval's checkpoint skipped"
                    );
                }
            }
        }
    }

    fn record_drops(&mut self, dropped: &AtomicU64, reported: &mut u64) {
        let now = dropped.load(Ordering::Relaxed);
        if now > *reported {
            let seq = self.next_seq;
            self.next_seq += 1;
            let ts = mono_now_ns();
            let wall = self.wall(ts);
            let node = self.cfg.node;
            if let Some(b) = self.builders.get_mut(&Table::WriterEvents) {
                b.push_writer_event(node, seq, ts, wall, "dropped", now - *reported);
            }
            tracing::error!(
                dropped = now - *reported,
                total = now,
                "audit events dropped (allow_drop mode)"
            );
            self.pending_rows += 1;
            *reported = now;
        }
    }

    fn push(&mut self, ev: &Event) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let wall = self.wall(ev.ts_ns());
        let node = self.cfg.node;
        if let Some(b) = self.builders.get_mut(&Table::of(ev)) {
            b.push(node, seq, wall, ev);
        }
        self.pending_rows += 1;
    }

    /// Rows that arrive as columns: numbered and wrapped as one record batch, no per-row work.
    fn push_rdma_ops(&mut self, rows: RdmaOpRows) {
        let n = rows.len();
        if n == 0 {
            return;
        }
        let table = Table::RdmaOps;
        // Rows of this table already in its builder come first: seq order within the file.
        if let Some(b) = self.builders.get_mut(&table)
            && !b.is_empty()
        {
            let earlier = b.finish();
            self.batches.entry(table).or_default().push(earlier);
        }
        let seq = self.next_seq;
        self.next_seq += n as u64;
        let batch = schema::rdma_ops_batch(self.cfg.node, seq, |ts| self.wall(ts), rows);
        debug_assert_eq!(batch.num_rows(), n);
        self.batches.entry(table).or_default().push(batch);
        self.pending_rows += n;
    }

    /// Write buffered rows to the live segment; fsync per policy (or always if `force_sync`).
    /// Each table's rows go as one record batch (its column batches, then its builder's rows).
    fn flush_batch(&mut self, force_sync: bool) -> Result<(), WriterError> {
        let dir = live_dir(&self.cfg.root, self.cfg.node);
        for (table, b) in &mut self.builders {
            let mut parts = self.batches.remove(table).unwrap_or_default();
            if !b.is_empty() {
                parts.push(b.finish());
            }
            let batch = match parts.len() {
                0 => continue,
                1 => parts.pop().unwrap_or_else(|| unreachable!("one part")),
                _ => arrow::compute::concat_batches(&table.schema(), &parts)?,
            };
            // Its leaves are hashed on the hasher's thread, off this one.
            self.hasher.submit(*table, batch.clone())?;
            if !self.live.contains_key(table) {
                let path = dir.join(format!("{:016}-{}.arrows", self.segment, table.name()));
                let file = OpenOptions::new()
                    .create(true)
                    .truncate(true)
                    .write(true)
                    .open(&path)
                    .map_err(io(&path))?;
                let writer = StreamWriter::try_new(BufWriter::new(file), &table.schema())?;
                self.live.insert(*table, Live { path, writer });
                self.live_dir_dirty = true;
            }
            let live = self
                .live
                .get_mut(table)
                .ok_or_else(|| WriterError::Closed("live segment vanished".into()))?;
            live.writer.write(&batch)?;
            live.writer.flush()?;
            self.live_bytes += batch.get_array_memory_size() as u64;
        }
        self.pending_rows = 0;
        self.absorb_leaves(false)?;
        let due = match self.cfg.fsync {
            FsyncPolicy::EveryBatch => true,
            FsyncPolicy::Interval(d) => self.last_fsync.elapsed() >= d,
            FsyncPolicy::Never => false,
        };
        if force_sync || due {
            for live in self.live.values_mut() {
                live.writer
                    .get_mut()
                    .get_ref()
                    .sync_data()
                    .map_err(io(&live.path))?;
            }
            // The directory's entries only change when a live file is created: fsync it then,
            // not after every batch (each is a journal commit).
            if self.live_dir_dirty {
                fsync_dir(&dir)?;
                self.live_dir_dirty = false;
            }
            self.last_fsync = Instant::now();
        }
        Ok(())
    }

    /// Seal the live segment: finish the IPC streams, convert to Parquet, write the digest, remove
    /// the live files.
    fn rotate(&mut self) -> Result<(), WriterError> {
        self.flush_batch(true)?;
        if self.live.is_empty() {
            return Ok(());
        }
        let mut batches: BTreeMap<Table, Vec<RecordBatch>> = BTreeMap::new();
        let mut paths = Vec::new();
        for (table, mut live) in std::mem::take(&mut self.live) {
            live.writer.finish()?;
            paths.push(live.path.clone());
            batches.insert(table, read_live(&live.path)?);
        }
        self.seal(batches)?;
        for p in &paths {
            fs::remove_file(p).map_err(io(p))?;
        }
        fsync_dir(&live_dir(&self.cfg.root, self.cfg.node))?;
        self.live_bytes = 0;
        self.segment_started = Instant::now();
        Ok(())
    }

    /// Write each table's batches as one Parquet file and chain a signed digest over them.
    fn seal(&mut self, batches: BTreeMap<Table, Vec<RecordBatch>>) -> Result<(), WriterError> {
        let sealed_wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        let date = utc_date(sealed_wall);
        let seq_start = self.segment_seq_start;
        let seq_end = self.next_seq;
        // One leaf per sequence number: hashed as the rows were flushed, or (a previous run's
        // live segment, recovered) from the very batches about to be sealed.
        self.absorb_leaves(true)?;
        let t_leaves = Instant::now();
        let hashed = std::mem::replace(
            &mut self.live_leaves,
            leaf::SegmentLeaves::new(self.cfg.node, seq_end),
        );
        let rows: usize = batches.values().flatten().map(RecordBatch::num_rows).sum();
        let leaves = if hashed.rows() == rows {
            hashed.finish(seq_end)
        } else {
            debug_assert_eq!(hashed.rows(), 0, "a segment is hashed whole or not at all");
            leaf::leaves_of_tables(self.cfg.node, seq_start, seq_end, &batches)
        }
        .map_err(|e| WriterError::Tree(e.into()))?;
        let leaves_ns = t_leaves.elapsed().as_nanos() as u64;
        let mut files = Vec::new();
        for (table, bs) in batches {
            let rows: usize = bs.iter().map(RecordBatch::num_rows).sum();
            if rows == 0 {
                continue;
            }
            let rel = PathBuf::from(table.name())
                .join(format!("node={}", self.cfg.node))
                .join(format!("date={date}"))
                .join(format!("{:016}.parquet", self.segment));
            let path = self.cfg.root.join(&rel);
            let dir = path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| self.cfg.root.clone());
            fs::create_dir_all(&dir).map_err(io(&dir))?;
            let tmp = dir.join(format!(".{:016}.parquet.tmp", self.segment));
            let mut props = WriterProperties::builder()
                .set_compression(Compression::ZSTD(ZstdLevel::try_new(1)?))
                .set_key_value_metadata(Some(vec![KeyValue::new(
                    SCHEMA_VERSION_KEY.to_owned(),
                    SCHEMA_VERSION.to_owned(),
                )]));
            // Near-monotonic, all-distinct columns: delta encoding, no dictionary (a dictionary
            // would hash every value only to be abandoned).
            for c in ["seq", "ts_ns", "wall_ns", "request_id", "ktime_ns"] {
                let col = parquet::schema::types::ColumnPath::from(c);
                props = props
                    .set_column_dictionary_enabled(col.clone(), false)
                    .set_column_encoding(col, parquet::basic::Encoding::DELTA_BINARY_PACKED);
            }
            // The witness's tables: no dictionaries at all. They are written at the transfer
            // path's rate (5 rows per page), their ids and addresses are mostly distinct, and
            // zstd packs the repetitive small columns nearly as well: dictionary building was
            // the largest part of sealing them (`custody audit bench --witness`).
            if matches!(table, Table::RdmaOps | Table::RdmaMr) {
                props = props.set_dictionary_enabled(false);
            }
            let props = props.build();
            let file = File::create(&tmp).map_err(io(&tmp))?;
            let mut w = ArrowWriter::try_new(file, table.schema(), Some(props))?;
            for b in &bs {
                w.write(b)?;
            }
            let file = w.into_inner()?;
            file.sync_all().map_err(io(&tmp))?;
            drop(file);
            fs::rename(&tmp, &path).map_err(io(&path))?;
            fsync_dir(&dir)?;
            let (sha256, bytes) = digest::sha256_file(&path).map_err(io(&path))?;
            files.push(SealedFile {
                path: rel.to_string_lossy().into_owned(),
                table: table.name().to_owned(),
                sha256,
                bytes,
                rows: rows as u64,
            });
        }
        if files.is_empty() {
            return Ok(());
        }
        let t_tree = Instant::now();
        let tree = self.grow_tree(leaves)?;
        let tree_ns = leaves_ns + t_tree.elapsed().as_nanos() as u64;
        let d = DigestFile::new(
            &self.chain,
            self.cfg.node,
            self.segment,
            seq_start,
            seq_end,
            sealed_wall,
            files,
            tree,
            &self.cfg.signing_key,
        );
        self.chain = d.write(&self.cfg.root).map_err(WriterError::Digest)?;
        let t_note = Instant::now();
        self.write_note()?;
        self.tree_ns.fetch_add(
            tree_ns + t_note.elapsed().as_nanos() as u64,
            Ordering::Relaxed,
        );
        self.segment += 1;
        self.segment_seq_start = self.next_seq;
        self.checkpoint(Urgency::Skippable);
        Ok(())
    }
}

impl State {
    /// Answers a lookup in the request index or spans: what was received so far written
    /// (without fsync) and hashed first, so every event recorded before the question is in.
    /// An error stops the writer (the caller hears it as the reason).
    fn look_up<T: Clone>(
        &mut self,
        reply: &SyncSender<Result<T, WriterError>>,
        find: impl FnOnce(&mut Self) -> T,
    ) -> Result<(), WriterError> {
        let r = self
            .flush_batch(false)
            .and_then(|()| self.absorb_leaves(true))
            .map(|()| find(self));
        // Not delivered only if the asker gave up waiting.
        let _ = reply.send(
            r.as_ref()
                .map(Clone::clone)
                .map_err(|e| WriterError::Closed(e.to_string())),
        );
        r.map(|_| ())
    }

    /// Takes the hasher's finished batches (`all`: waits for every one submitted): each row's
    /// leaf into the live segment's, and requests' rows into the promise index and the spans.
    fn absorb_leaves(&mut self, all: bool) -> Result<(), WriterError> {
        while let Some((table, rows)) = self.hasher.next(all)? {
            for r in rows {
                self.live_leaves
                    .place(r.seq, r.leaf)
                    .map_err(|e| WriterError::Tree(e.into()))?;
                if let Some(request) = r.request {
                    self.spans.add(request, r.seq);
                    let at = LeafRef {
                        seq: r.seq,
                        table: table.name(),
                        leaf: r.leaf,
                    };
                    self.requests.add(request, at, r.end);
                }
            }
        }
        Ok(())
    }

    /// Signs the tree as it stands (a C2SP checkpoint note) and writes it durably.
    fn write_note(&self) -> Result<(), WriterError> {
        let root = self.tree.root().map_err(|e| WriterError::Tree(e.into()))?;
        let note = tlog::sign_checkpoint(&self.note_signer, self.tree.size(), root)
            .map_err(|e| WriterError::Tree(e.into()))?;
        Ok(self.tree_dir.write_checkpoint(&note)?)
    }

    /// Appends a sealed segment's leaves and writes the tiles that changed, durably, before
    /// any digest names the tree.
    fn grow_tree(&mut self, leaves: Vec<Hash>) -> Result<TreeHead, WriterError> {
        let old = self.tree.size();
        assert_eq!(
            old, self.segment_seq_start,
            "the tree holds one leaf per sealed sequence number"
        );
        for l in leaves {
            self.tree
                .append_leaf(l)
                .map_err(|e| WriterError::Tree(e.into()))?;
        }
        debug_assert_eq!(self.tree.size(), self.next_seq);
        let mut tiles = self.tree.take_full_tiles();
        tiles.extend(self.tree.partial_tiles(old));
        self.tree_dir.write_tiles(&tiles, self.cfg.level0_tiles)?;
        let root = self.tree.root().map_err(|e| WriterError::Tree(e.into()))?;
        Ok(TreeHead {
            size: self.tree.size(),
            root: root.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Witness rows handed over as columns (`record_rdma_ops`) and as events (`record`), mixed
    /// with another table's events, seal into one `rdma_ops` file in seq order with every value
    /// intact (nullable strings included), and the store verifies.
    #[test]
    fn witness_columns_and_events_seal_together_in_seq_order() {
        use crate::{RdmaOp, RdmaOpRows};
        use arrow::array::{Array, AsArray};
        use arrow::datatypes::{Int64Type, UInt64Type};
        let root = std::env::temp_dir().join(format!("custody-rdmacols-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let key = digest::generate_key().expect("key");
        let verifying = key.verifying_key();
        let w = AuditWriter::open(WriterConfig::new(&root, 3, key)).expect("open");
        let op = |i: u64| RdmaOp {
            ts_ns: 1_000 + i,
            ktime_ns: 5_000 + i,
            pid: 11,
            tid: 12,
            op: if i.is_multiple_of(2) {
                "post_write"
            } else {
                "complete"
            },
            ctx: (3 << 32) | 1,
            wr_id: 0x100 + i,
            chain_index: i as u32,
            opcode: 1,
            flags: 2,
            imm: 7,
            remote_addr: 0x10_0000 + i,
            rkey: 9,
            num_sge: 3,
            bytes: 10 * i,
            status: -(i as i32),
            qp_num: 4,
            sges: (i == 1).then(|| "0x10:4:0".to_owned()),
            probe_flags: (i == 2).then(|| "read_fault".to_owned()),
        };
        let cols = |r: std::ops::Range<u64>| {
            let mut rows = RdmaOpRows::default();
            r.for_each(|i| rows.push(op(i)));
            rows
        };
        w.record(Event::RdmaOp(Box::new(op(0)))).expect("event");
        w.record_rdma_ops(cols(1..3)).expect("columns");
        w.record(Event::Node {
            ts_ns: 1_500,
            kind: "test".into(),
            detail: String::new(),
        })
        .expect("node");
        w.record(Event::RdmaOp(Box::new(op(3)))).expect("event");
        w.record_rdma_ops(cols(4..6)).expect("columns");
        assert_eq!(w.sync().expect("sync"), 7, "seven rows, each numbered once");
        w.close().expect("close");

        let report = digest::verify(&root, Some(&verifying), None, None);
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        let file = report
            .verified_files
            .iter()
            .find(|p| p.to_string_lossy().contains("rdma_ops"))
            .expect("a sealed rdma_ops file");
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
            File::open(root.join(file)).expect("open parquet"),
        )
        .expect("parquet")
        .build()
        .expect("reader");
        let batches: Vec<RecordBatch> = reader.map(|b| b.expect("batch")).collect();
        let b = arrow::compute::concat_batches(&batches[0].schema(), &batches).expect("concat");
        assert_eq!(b.num_rows(), 6);
        let col = |n: &str| b.column_by_name(n).expect(n).clone();
        let seq: Vec<u64> = col("seq").as_primitive::<UInt64Type>().values().to_vec();
        assert_eq!(
            seq,
            [0, 1, 2, 4, 5, 6],
            "seq order, the node event's 3 elsewhere"
        );
        let wr: Vec<u64> = col("wr_id").as_primitive::<UInt64Type>().values().to_vec();
        assert_eq!(wr, (0x100..0x106).collect::<Vec<_>>());
        let ts = col("ts_ns");
        let wall = col("wall_ns");
        let (ts, wall) = (
            ts.as_primitive::<UInt64Type>(),
            wall.as_primitive::<Int64Type>(),
        );
        let offset = wall.value(0) - ts.value(0) as i64;
        assert!((0..6).all(|i| wall.value(i) - ts.value(i) as i64 == offset));
        let ops = col("op");
        assert_eq!(ops.as_string::<i32>().value(3), "complete");
        let sges = col("sges");
        let sges = sges.as_string::<i32>();
        assert_eq!((sges.value(1), sges.null_count()), ("0x10:4:0", 5));
        let flags = col("probe_flags");
        assert_eq!(flags.as_string::<i32>().value(2), "read_fault");
        let status = col("status");
        assert_eq!(
            status
                .as_primitive::<arrow::datatypes::Int32Type>()
                .value(5),
            -5
        );
        let node = col("node_id");
        assert!(
            node.as_primitive::<arrow::datatypes::UInt32Type>()
                .values()
                .iter()
                .all(|&n| n == 3)
        );
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(951_782_400 * 1_000_000_000), "2000-02-29");
        assert_eq!(utc_date(1_796_000_000 * 1_000_000_000), "2026-11-30");
        assert_eq!(utc_date(-1), "1969-12-31");
    }

    #[test]
    fn queue_depth_counts_what_the_writer_has_not_taken() {
        let root = std::env::temp_dir().join(format!("custody-qdepth-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let key = digest::generate_key().expect("key");
        let mut cfg = WriterConfig::new(&root, 0, key);
        cfg.queue_capacity = 4096;
        let w = AuditWriter::open(cfg).expect("open");
        assert_eq!(w.queue_capacity(), 4096);
        assert_eq!(w.queue_depth(), 0);
        for i in 0..1000 {
            w.record(Event::Node {
                ts_ns: i,
                kind: "test".into(),
                detail: String::new(),
            })
            .expect("record");
        }
        assert!(w.queue_depth() <= 1000);
        // `sync` returns after the writer took (and wrote) everything queued before it.
        assert_eq!(w.sync().expect("sync"), 1000);
        assert_eq!(w.queue_depth(), 0);
        w.close().expect("close");
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn record_all_hands_over_whole_batches_and_refuses_after_close() {
        let root = std::env::temp_dir().join(format!("custody-recall-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let key = digest::generate_key().expect("key");
        let mut cfg = WriterConfig::new(&root, 0, key);
        // Smaller than the batches below: a batch waits for an empty queue, then goes alone.
        cfg.queue_capacity = 64;
        let w = AuditWriter::open(cfg).expect("open");
        let batch = |k: u64| -> Vec<Event> {
            (0..100)
                .map(|i| Event::Node {
                    ts_ns: k * 100 + i,
                    kind: "test".into(),
                    detail: String::new(),
                })
                .collect()
        };
        for k in 0..10 {
            w.record_all(batch(k)).expect("record_all");
            assert!(w.queue_depth() <= 100, "one batch in the queue at most");
        }
        assert_eq!(w.sync().expect("sync"), 1000, "every event, once");
        w.close().expect("close");
        assert!(matches!(w.record_all(batch(10)), Err(SinkError::Closed(_))));
        let _ = fs::remove_dir_all(&root);
    }
}

#[cfg(test)]
mod promise_tests {
    use super::*;
    use crate::{PageKind, RequestKind};

    fn request(request: u64, tenant: &str, kind: RequestKind) -> Event {
        Event::Request {
            ts_ns: 1,
            request,
            tenant: tenant.into(),
            kind,
            prompt_tokens: 5,
            output_tokens: 3,
        }
    }

    fn page(request: u64, tenant: &str) -> Event {
        Event::Page {
            ts_ns: 2,
            request,
            tenant: tenant.into(),
            page: 4,
            generation: 1,
            kind: PageKind::Alloc,
        }
    }

    /// The promise an answer carries names exactly its request's records, by the leaf hashes
    /// the seal then puts in the tree: each proves included at its seq in the sealed tree, the
    /// sealed receipt keeps the promise, and a promise of another request does not fit it.
    #[test]
    fn a_promise_names_the_leaves_the_seal_puts_in_the_tree() {
        let root = std::env::temp_dir().join(format!("custody-promise-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let key = digest::generate_key().expect("key");
        let vk = key.verifying_key();
        let w = AuditWriter::open(WriterConfig::new(&root, 0, key)).expect("open");
        let finished = || RequestKind::Finished {
            reason: "stop".into(),
        };
        for ev in [
            request(7, "acme", RequestKind::Admitted),
            request(8, "beta", RequestKind::Admitted),
            page(7, "acme"),
            Event::Node {
                ts_ns: 3,
                kind: "test".into(),
                detail: String::new(),
            },
            page(8, "beta"),
            request(7, "acme", finished()),
        ] {
            w.record(ev).expect("record");
        }
        let PromiseReply::Signed { promise, note } = w.receipt_promise("acme", 7).expect("ask")
        else {
            panic!("request 7 ended: its promise is signed");
        };
        let seqs: Vec<u64> = promise.leaves.iter().map(|l| l.seq).collect();
        assert_eq!(seqs, [0, 2, 5]);
        assert_eq!(promise.request_id, "req-0-7");
        // Once per request; a running request gets none.
        assert_eq!(
            w.receipt_promise("acme", 7).expect("ask"),
            PromiseReply::Unknown
        );
        assert_eq!(
            w.receipt_promise("beta", 8).expect("ask"),
            PromiseReply::Running
        );
        w.record(request(8, "beta", finished())).expect("record");
        let PromiseReply::Signed { note: note8, .. } = w.receipt_promise("beta", 8).expect("ask")
        else {
            panic!("request 8 ended");
        };
        w.rotate().expect("seal");
        let store = digest::LocalStore::new(&root);
        let log = tree_store::NodeLog::open(&store, 0).expect("log");
        let size = 7;
        let root_hash = log.root_at(size).expect("root");
        for l in &promise.leaves {
            let proof = log.prove_inclusion(l.seq, size).expect("prove");
            tlog::verify_inclusion(&proof, size, root_hash, l.seq, l.leaf)
                .unwrap_or_else(|e| panic!("seq {}: {e}", l.seq));
        }
        let tree_store::ReceiptStatus::Ready(json) =
            tree_store::request_receipt(&store, 0, 0, "acme", 7).expect("receipt")
        else {
            panic!("sealed: the receipt is ready");
        };
        let checked = tree_store::verify_receipt(&json, &vk, None).expect("receipt checks");
        let kept = tree_store::check_promise(&checked, &note, &vk).expect("promise kept");
        assert_eq!(kept.promised, 3);
        assert!(kept.unpromised.is_empty());
        // Another request's promise is not this receipt's.
        assert!(tree_store::check_promise(&checked, &note8, &vk).is_err());
        w.close().expect("close");
        let _ = fs::remove_dir_all(&root);
    }
}

/// Batches the hasher may hold before a submit waits (each ≤ `batch_rows` rows).
const HASHER_QUEUE_BATCHES: usize = 64;

/// A hashed batch: its table and each row's leaf.
type Hashed = Result<(Table, Vec<leaf::RowLeaf>), leaf::LeafError>;

/// The leaf hasher: the writer hands it each batch it writes to the live segment and takes the
/// rows' leaves back in the same order (`absorb_leaves`): SHA-256 over every record's canonical
/// bytes is most of the tree's cost, and it runs here, off the writer's thread. Every batch
/// submitted is taken back before a seal, a promise or a span lookup uses the leaves.
struct LeafHasher {
    jobs: SyncSender<(Table, RecordBatch)>,
    results: Receiver<Hashed>,
    /// Submitted, not yet taken back.
    outstanding: usize,
    /// The hasher thread's CPU time so far, ns (for the benchmark).
    cpu_ns: Arc<AtomicU64>,
}

impl std::fmt::Debug for LeafHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafHasher")
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

impl LeafHasher {
    fn start(node: u32, tree_ns: Arc<AtomicU64>) -> Result<Self, WriterError> {
        let (jobs, rx) = mpsc::sync_channel::<(Table, RecordBatch)>(HASHER_QUEUE_BATCHES);
        // Unbounded, yet never holding more than `outstanding` (at most the jobs' queue + 1).
        let (tx, results) = mpsc::channel::<Hashed>();
        let cpu_ns = Arc::new(AtomicU64::new(0));
        let cpu = cpu_ns.clone();
        std::thread::Builder::new()
            .name(format!("audit-leaves-{node}"))
            .spawn(move || {
                // Ends when the writer drops its side.
                while let Ok((table, batch)) = rx.recv() {
                    let t0 = Instant::now();
                    let hashed = leaf::batch_leaves(table, &batch).map(|rows| (table, rows));
                    tree_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    cpu.store(thread_cpu_ns(), Ordering::Relaxed);
                    if tx.send(hashed).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| WriterError::Closed(e.to_string()))?;
        Ok(Self {
            jobs,
            results,
            outstanding: 0,
            cpu_ns,
        })
    }

    fn submit(&mut self, table: Table, batch: RecordBatch) -> Result<(), WriterError> {
        self.jobs
            .send((table, batch))
            .map_err(|_| WriterError::Closed("the leaf hasher stopped".into()))?;
        self.outstanding += 1;
        Ok(())
    }

    /// The next hashed batch: waited for when `wait` and one is outstanding; `None` when none
    /// is outstanding (or, not waiting, none is ready yet).
    fn next(&mut self, wait: bool) -> Result<Option<(Table, Vec<leaf::RowLeaf>)>, WriterError> {
        if self.outstanding == 0 {
            return Ok(None);
        }
        let got = if wait {
            self.results.recv().map_err(|_| TryRecvError::Disconnected)
        } else {
            self.results.try_recv()
        };
        match got {
            Ok(hashed) => {
                self.outstanding -= 1;
                hashed.map(Some).map_err(|e| WriterError::Tree(e.into()))
            }
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => {
                Err(WriterError::Closed("the leaf hasher stopped".into()))
            }
        }
    }
}

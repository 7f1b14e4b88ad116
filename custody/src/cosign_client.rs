//! The node's side of its tlog witnesses: after every checkpoint the writer publishes, a
//! thread of its own sends the node's newest tree checkpoint to each `[audit] witnesses`
//! entry (`custody_audit::tree_store::cosign_newest`) over plain HTTP/1.1, and keeps what they
//! cosign in `_tlog/node=<n>/cosigned`. A witness that is down or refuses never stops serving:
//! the failure is logged, counted, and recorded in the node's own audit log (`node_events`
//! `tlog_uncosigned`), and the next checkpoint tries again.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Weak};

use anyhow::{Context, Result};
use custody_audit::AuditSink as _;
use custody_audit::checkpoint::{Checkpoint, CheckpointSink, PublishError};
use custody_audit::tree_store::{self, WitnessTarget};
use custody_audit::writer::AuditWriter;
use custody_server::tlog_witness::HttpTransport;

/// The writer's checkpoint sink that wakes the cosigner (never blocks the publisher: a round
/// already pending covers this checkpoint too).
#[derive(Debug)]
struct Trigger(SyncSender<()>);

impl CheckpointSink for Trigger {
    fn publish(&self, _cp: &Checkpoint) -> Result<(), PublishError> {
        match self.0.try_send(()) {
            Ok(()) | Err(TrySendError::Full(())) => Ok(()),
            // The cosigner stopped (it only stops when this sink is dropped).
            Err(TrySendError::Disconnected(())) => Ok(()),
        }
    }
}

/// Rounds that ended without every configured witness's cosignature; and, with `[audit]
/// require_cosignatures`, whether the newest round got fewer than required.
#[derive(Debug, Default)]
pub(crate) struct CosignStats {
    pub(crate) uncosigned_rounds: AtomicU64,
    pub(crate) below_required: std::sync::atomic::AtomicBool,
}

/// A running cosigner: the sink to add to the writer's, the slot its log goes in once open
/// (failures are recorded there), and its counters.
pub(crate) struct Cosigner {
    pub(crate) sink: Arc<dyn CheckpointSink>,
    pub(crate) writer: Arc<std::sync::OnceLock<Weak<AuditWriter>>>,
    pub(crate) stats: Arc<CosignStats>,
}

/// Starts the cosigner's thread (it waits for the sink's first checkpoint).
pub(crate) fn start(
    root: PathBuf,
    node: u32,
    witnesses: Vec<WitnessTarget>,
    required: usize,
) -> Result<Cosigner> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let writer = Arc::new(std::sync::OnceLock::new());
    let stats = Arc::new(CosignStats::default());
    let (w, st) = (writer.clone(), stats.clone());
    std::thread::Builder::new()
        .name(format!("tlog-cosign-{node}"))
        .spawn(move || run(&rx, &root, node, &witnesses, required, &w, &st))
        .context("starting the tlog cosigner")?;
    Ok(Cosigner {
        sink: Arc::new(Trigger(tx)),
        writer,
        stats,
    })
}

fn run(
    rx: &Receiver<()>,
    root: &std::path::Path,
    node: u32,
    witnesses: &[WitnessTarget],
    required: usize,
    writer: &std::sync::OnceLock<Weak<AuditWriter>>,
    stats: &CosignStats,
) {
    let mut known = std::collections::BTreeMap::new();
    while rx.recv().is_ok() {
        let round = tree_store::cosign_newest(root, node, witnesses, &HttpTransport, &mut known);
        let got = match &round {
            Ok(r) => r.cosigned_by.len(),
            // Nothing sealed yet: nothing that could lack a cosignature.
            Err(tree_store::ProofError::NoCheckpoint { .. }) => required,
            Err(_) => 0,
        };
        let below = got < required;
        if below != stats.below_required.swap(below, Ordering::Relaxed) {
            if below {
                tracing::error!(
                    node,
                    got,
                    required,
                    "tree checkpoint below its required cosignatures: taking no new work (require_cosignatures)"
                );
            } else {
                tracing::info!(
                    node,
                    got,
                    required,
                    "tree checkpoint cosigned as required: serving again"
                );
            }
        }
        let missing: Vec<String> = match round {
            Ok(r) if r.failures.is_empty() => {
                tracing::info!(
                    node,
                    size = r.size,
                    witnesses = r.cosigned_by.len(),
                    "tree checkpoint cosigned"
                );
                continue;
            }
            Ok(r) => r
                .failures
                .iter()
                .map(|(url, why)| format!("{url}: {why}"))
                .collect(),
            // No checkpoint yet (nothing sealed): nothing to cosign.
            Err(tree_store::ProofError::NoCheckpoint { .. }) => continue,
            Err(e) => vec![e.to_string()],
        };
        stats.uncosigned_rounds.fetch_add(1, Ordering::Relaxed);
        let detail = missing.join("; ");
        tracing::error!(node, %detail, "tree checkpoint lacks cosignatures");
        if let Some(w) = writer.get().and_then(Weak::upgrade) {
            let ev = custody_audit::Event::Node {
                ts_ns: custody_audit::mono_now_ns(),
                kind: "tlog_uncosigned".into(),
                detail,
            };
            // A closed log is the node stopping: nothing more to record.
            let _ = w.record(ev);
        }
    }
}

/// `[audit] require_cosignatures` on a pair's or fleet's node: no new work while the newest
/// checkpoint has fewer cosignatures than required.
#[derive(Debug)]
pub(crate) struct Gate(pub(crate) Arc<CosignStats>);

impl custody_runtime::disagg::proofs::AuditGate for Gate {
    fn refusal(&self) -> Option<String> {
        self.0.below_required.load(Ordering::Relaxed).then(|| {
            "this node's audit log is not cosigned by its witnesses ([audit] require_cosignatures), so it takes no new work (fail-closed)".to_owned()
        })
    }
}

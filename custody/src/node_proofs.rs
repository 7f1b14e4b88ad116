//! The server's `AuditProofs` over this node's audit root (the server links no writer): thin
//! glue over `custody_audit::tree_store`.

use std::path::PathBuf;

use custody_audit::digest::LocalStore;
use custody_audit::tlog::{Checkpoint, ConsistencyProof};
use custody_audit::tree_store::{self, NodeLog, ReceiptStatus};
use custody_audit::writer::PromiseReply;
use custody_server::receipts::{AuditProofs, Promised, ProofsError, Receipt};

/// A node's root; `from_seq`: where this incarnation's records start (request ids restart with
/// the process, so a receipt looks only at records from there on).
#[derive(Debug)]
pub(crate) struct RootProofs {
    pub(crate) root: PathBuf,
    pub(crate) node: u32,
    pub(crate) from_seq: u64,
    /// Flushed before a lookup, so a request that just ended is in the live segment at least.
    pub(crate) writer: std::sync::Arc<custody_audit::writer::AuditWriter>,
}

fn err(e: impl std::fmt::Display) -> ProofsError {
    ProofsError(e.to_string())
}

impl AuditProofs for RootProofs {
    fn promise(&self, tenant: &str, request: u64) -> Result<Promised, ProofsError> {
        Ok(
            match self.writer.receipt_promise(tenant, request).map_err(err)? {
                PromiseReply::Signed { promise, note } => Promised::Signed { promise, note },
                PromiseReply::Running => {
                    Promised::Unavailable("the request's end is not in the log yet")
                }
                PromiseReply::Incomplete => Promised::Unavailable(
                    "the writer's index of recent requests was full: not every record of the request is listed, so none is promised (fetch the receipt once sealed)",
                ),
                PromiseReply::Unknown => Promised::Unavailable(
                    "no record of the request in the writer's index of recent requests (fetch the receipt once sealed)",
                ),
            },
        )
    }

    fn receipt(&self, tenant: &str, request: u64) -> Result<Receipt, ProofsError> {
        let store = LocalStore::new(&self.root);
        let look =
            || tree_store::request_receipt(&store, self.node, self.from_seq, tenant, request);
        let mut r = look().map_err(err)?;
        if r == ReceiptStatus::Unknown {
            // Perhaps it just ended and its rows are still queued: flush them to the live
            // segment and look again (only then: a sync is an fsync).
            self.writer.sync().map_err(err)?;
            r = look().map_err(err)?;
        }
        Ok(match r {
            ReceiptStatus::Ready(json) => Receipt::Ready(json),
            ReceiptStatus::Pending => Receipt::Pending,
            ReceiptStatus::Unknown => Receipt::Unknown,
        })
    }

    fn checkpoint(&self) -> Result<Vec<u8>, ProofsError> {
        let store = LocalStore::new(&self.root);
        let log = NodeLog::open(&store, self.node).map_err(err)?;
        let newest = log.checkpoint_note().map_err(err)?;
        let size = checkpoint_of(&newest)?.size();
        // The cosigned one when it is the newest.
        log.cosigned_or_newest(size.saturating_sub(1)).map_err(err)
    }

    fn consistency(&self, old: u64) -> Result<Vec<u8>, ProofsError> {
        let store = LocalStore::new(&self.root);
        let log = NodeLog::open(&store, self.node).map_err(err)?;
        let note = self.checkpoint()?;
        let size = checkpoint_of(&note)?.size();
        let hashes = if old == size {
            Vec::new()
        } else {
            log.prove_consistency(old, size).map_err(err)?
        };
        Ok(ConsistencyProof {
            old,
            hashes,
            checkpoint: note,
        }
        .to_bytes())
    }
}

fn checkpoint_of(note: &[u8]) -> Result<Checkpoint, ProofsError> {
    custody_audit::tlog::note_checkpoint(note).map_err(err)
}

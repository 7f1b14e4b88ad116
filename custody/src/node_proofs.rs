//! The server's `AuditProofs` over this node's audit root (the server links no writer): thin
//! glue over `custody_audit::tree_store`.

use std::path::PathBuf;

use custody_audit::digest::LocalStore;
use custody_audit::request_index::SpanLookup;
use custody_audit::tlog::{Checkpoint, ConsistencyProof, InclusionProof};
use custody_audit::tree_store::{self, NodeLog, ReceiptStatus};
use custody_audit::writer::PromiseReply;
use custody_runtime::disagg::proofs::NodeProofs;
use custody_runtime::disagg::proto;
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

/// How long a promise waits for a request's end record: a request the server ended itself (a
/// stop sequence, n > 1's siblings) has its end recorded by the engine a moment after.
const PROMISE_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

impl RootProofs {
    /// Only this node's own log is here.
    fn own(&self, node: u32) -> Result<(), ProofsError> {
        if node == self.node {
            Ok(())
        } else {
            Err(ProofsError(format!(
                "this is node {}: it keeps no log of node {node}",
                self.node
            )))
        }
    }

    /// The writer's promise of `request`, waiting (bounded) while its end is not recorded yet.
    fn promise_reply(&self, tenant: &str, request: u64) -> Result<PromiseReply, ProofsError> {
        let t0 = std::time::Instant::now();
        let mut pause = std::time::Duration::from_millis(1);
        loop {
            let r = self.writer.receipt_promise(tenant, request).map_err(err)?;
            if r != PromiseReply::Running || t0.elapsed() + pause > PROMISE_WAIT {
                return Ok(r);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(50));
        }
    }
}

impl AuditProofs for RootProofs {
    fn promise(&self, tenant: &str, request: u64) -> Result<Promised, ProofsError> {
        let why = match self.promise_reply(tenant, request)? {
            PromiseReply::Signed { promise, note } => {
                return Ok(Promised::Signed { promise, note });
            }
            PromiseReply::Running => "the request's end is not in the log yet",
            PromiseReply::Incomplete => {
                "the writer's index of recent requests was full: not every record of the request is listed, so none is promised (fetch the receipt once sealed)"
            }
            PromiseReply::Unknown => {
                "no record of the request in the writer's index of recent requests (fetch the receipt once sealed)"
            }
        };
        Ok(Promised::Unavailable(why.to_owned()))
    }

    fn receipt(&self, tenant: &str, node: u32, request: u64) -> Result<Receipt, ProofsError> {
        if node != self.node {
            return Ok(Receipt::Unknown);
        }
        let store = LocalStore::new(&self.root);
        // Where its records are, from the writer (its rows written first, no fsync): only those
        // segments are read; an id this incarnation never used is unknown without a read.
        let span = match self.writer.request_span(request).map_err(err)? {
            SpanLookup::Found(s) => Some(s),
            SpanLookup::Unknown => return Ok(Receipt::Unknown),
            SpanLookup::Forgotten => None,
        };
        let r = tree_store::request_receipt_within(
            &store,
            self.node,
            self.from_seq,
            span,
            tenant,
            request,
        )
        .map_err(err)?;
        Ok(match r {
            ReceiptStatus::Ready(json) => Receipt::Ready(json),
            ReceiptStatus::Pending => Receipt::Pending,
            ReceiptStatus::Unknown => Receipt::Unknown,
        })
    }

    fn checkpoint(&self, node: u32) -> Result<Vec<u8>, ProofsError> {
        self.own(node)?;
        let store = LocalStore::new(&self.root);
        let log = NodeLog::open(&store, self.node).map_err(err)?;
        let newest = log.checkpoint_note().map_err(err)?;
        let size = checkpoint_of(&newest)?.size();
        // The cosigned one when it is the newest.
        log.cosigned_or_newest(size.saturating_sub(1)).map_err(err)
    }

    fn inclusion(&self, node: u32, seq: u64) -> Result<Vec<u8>, ProofsError> {
        self.own(node)?;
        let store = LocalStore::new(&self.root);
        let log = NodeLog::open(&store, self.node).map_err(err)?;
        let note = log.cosigned_or_newest(seq).map_err(err)?;
        let size = checkpoint_of(&note)?.size();
        if seq >= size {
            return Err(ProofsError(format!(
                "record {seq} is not in the node's newest checkpoint ({size} records) yet: ask again after the next seal"
            )));
        }
        Ok(InclusionProof {
            extra: None,
            index: seq,
            hashes: log.prove_inclusion(seq, size).map_err(err)?,
            checkpoint: note,
        }
        .to_bytes())
    }

    fn consistency(&self, node: u32, old: u64) -> Result<Vec<u8>, ProofsError> {
        self.own(node)?;
        let store = LocalStore::new(&self.root);
        let log = NodeLog::open(&store, self.node).map_err(err)?;
        let note = self.checkpoint(node)?;
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

/// The pair's and fleet's nodes answer the same questions over gRPC (`Prefill.Proof`,
/// `Decode.Proof`): status and body as the HTTP endpoints would.
impl NodeProofs for RootProofs {
    fn proof(&self, req: &proto::ProofRequest) -> proto::ProofReply {
        use custody_runtime::disagg::proofs::{
            CHECKPOINT, CONSISTENCY, INCLUSION, PROMISE, RECEIPT,
        };
        let reply = |status: u32, body: Vec<u8>| proto::ProofReply {
            status,
            body,
            promises: Vec::new(),
        };
        let said = |status: u32, why: &str| reply(status, why.as_bytes().to_vec());
        if req.node != self.node {
            return said(404, "not this node's log");
        }
        match req.what.as_str() {
            PROMISE => match self.promise(&req.tenant, req.request) {
                Ok(Promised::Signed { note, .. }) => reply(200, note),
                Ok(Promised::Unavailable(why)) => said(404, &why),
                Err(e) => said(503, &e.to_string()),
            },
            RECEIPT => match self.receipt(&req.tenant, req.node, req.request) {
                Ok(Receipt::Ready(json)) => reply(200, json),
                Ok(Receipt::Pending) => said(202, "not sealed and checkpointed yet"),
                Ok(Receipt::Unknown) => said(404, "no such request of yours on this node"),
                Err(e) => said(503, &e.to_string()),
            },
            CHECKPOINT => match self.checkpoint(req.node) {
                Ok(note) => reply(200, note),
                Err(e) => said(503, &e.to_string()),
            },
            CONSISTENCY => match self.consistency(req.node, req.old) {
                Ok(body) => reply(200, body),
                Err(e) => said(400, &e.to_string()),
            },
            INCLUSION => match self.inclusion(req.node, req.request) {
                Ok(body) => reply(200, body),
                Err(e) => said(404, &e.to_string()),
            },
            other => said(400, &format!("unknown proof {other:?}")),
        }
    }
}

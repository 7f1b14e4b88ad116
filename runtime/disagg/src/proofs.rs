//! Tenants' proofs from a pair's or fleet's nodes (issue 40): each node's signed promise of a
//! request's records, carried in the request's final token event, and receipts, checkpoints and
//! consistency proofs asked through the front door (`Prefill.Proof`, forwarded to a decode peer
//! for its own log by `Decode.Proof`).
//!
//! The runtime links no audit writer: the binary implements [`NodeProofs`] over the node's
//! writer and root.

use std::sync::Arc;

use tonic::Status;

use crate::proto;

/// `ProofRequest.what`: the signed promise of an ended request's records.
pub const PROMISE: &str = "promise";
/// `ProofRequest.what`, to a prefill node of its own request: its decode node's and its own
/// promises (`ProofReply.promises`) — what a front asks when it ended the request itself.
pub const PROMISES: &str = "promises";
/// `ProofRequest.what`: a request's receipt (`custody-receipt/1`), once sealed.
pub const RECEIPT: &str = "receipt";
/// `ProofRequest.what`: the node's newest (cosigned) checkpoint.
pub const CHECKPOINT: &str = "checkpoint";
/// `ProofRequest.what`: the consistency proof from a tree of `old` records to the newest.
pub const CONSISTENCY: &str = "consistency";
/// `ProofRequest.what`: the inclusion proof of record `request` (a seq), hashes only (no record
/// bytes: any tenant may ask for any seq).
pub const INCLUSION: &str = "inclusion";

/// A node's audit log, as tenants' proofs need it. Both calls block (a writer round trip, reads
/// of the root): callers run them on the blocking pool.
pub trait NodeProofs: Send + Sync + std::fmt::Debug {
    /// `req` asked of this node's own log: `status` 200 with the body (a promise note, a
    /// receipt's JSON, a checkpoint note, a consistency proof), 202 (receipt not sealed yet),
    /// 404 (no such request of that tenant, or no promise), 400 (a bad `old`), 503 (the log
    /// cannot answer now), the body then saying why.
    fn proof(&self, req: &proto::ProofRequest) -> proto::ProofReply;
}

/// `req` answered from this node's log on the blocking pool; `unimplemented` without one.
pub(crate) async fn local(
    proofs: Option<&Arc<dyn NodeProofs>>,
    req: proto::ProofRequest,
) -> Result<proto::ProofReply, Status> {
    let Some(p) = proofs.cloned() else {
        return Err(Status::unimplemented(
            "this node keeps no audit log to prove from",
        ));
    };
    tokio::task::spawn_blocking(move || p.proof(&req))
        .await
        .map_err(|e| Status::internal(format!("the proof task failed: {e}")))
}

/// A node's promise of `request`'s records as the final token event carries it: the note on
/// 200, else why there is none.
pub(crate) fn promise_of(
    node: u32,
    request: u64,
    r: Result<proto::ProofReply, Status>,
) -> proto::ReceiptPromise {
    let mut p = proto::ReceiptPromise {
        node,
        request,
        ..Default::default()
    };
    match r {
        Ok(reply) if reply.status == 200 => p.note = reply.body,
        Ok(reply) => p.error = String::from_utf8_lossy(&reply.body).into_owned(),
        Err(s) => p.error = s.message().to_owned(),
    }
    if p.note.is_empty() && p.error.is_empty() {
        p.error = "the node gave an empty promise".into();
    }
    p
}

/// The promise request of `request` (this node's id of it) for `tenant`.
pub(crate) fn promise_request(tenant: &str, node: u32, request: u64) -> proto::ProofRequest {
    proto::ProofRequest {
        tenant: tenant.to_owned(),
        node,
        what: PROMISE.into(),
        request,
        old: 0,
    }
}

/// Whether the node's audit log lets it take new work (`[audit] require_cosignatures`: not
/// while its newest checkpoint lacks the cosignatures required). Implemented by the binary
/// over its cosigner; a refusing node answers `unavailable` before anything is admitted or
/// reserved (a router retries elsewhere) and its readiness is 503.
pub trait AuditGate: Send + Sync + std::fmt::Debug {
    /// Why the node takes no new work now (`None`: it does).
    fn refusal(&self) -> Option<String>;
}

/// The gate's refusal as a gRPC status, marked as nothing posted (a router may retry).
pub(crate) fn refused(gate: Option<&Arc<dyn AuditGate>>) -> Result<(), Status> {
    match gate.and_then(|g| g.refusal()) {
        None => Ok(()),
        Some(why) => Err(crate::nothing_posted(Status::unavailable(format!(
            "audit_uncosigned: {why}"
        )))),
    }
}

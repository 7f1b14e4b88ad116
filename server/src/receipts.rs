//! A tenant's proof of what its own requests touched (issue 40), on the tenants' port, with the
//! tenant's own API key:
//!
//! - In every answer (the whole body, or each choice's final SSE chunk): `custody_receipt`, the
//!   node's signed promise of the request's records — their sequence numbers and leaf hashes —
//!   taken from the writer as the request ends ([`custody_receipt`]).
//! - `GET /v1/audit/receipt/{request_id}`: the `custody-receipt/1` of a request of this tenant
//!   on this node (`x-request-id`, `req-<node>-<n>`): every record of the request with its
//!   inclusion proof to the node's (cosigned) checkpoint. 202 until its records are sealed and
//!   in a checkpoint; 404 for an unknown request or another tenant's (indistinguishable).
//! - `GET /v1/audit/checkpoint`: the node's newest (cosigned) tree checkpoint.
//! - `GET /v1/audit/proof/consistency?old=N`: that the newest tree extends the one of `N`
//!   records (C2SP `tlog-witness` body), so a tenant holding an older checkpoint can follow.
//!
//! The server links no audit writer: the binary implements [`AuditProofs`] over the root.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};

use custody_runtime::disagg::proofs;
use custody_runtime::disagg::proto::{self, prefill_client::PrefillClient};
use tonic::transport::Channel;

use crate::error::ApiError;
use crate::http::AppState;

/// A request's receipt, as [`AuditProofs::receipt`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Receipt {
    /// The receipt's JSON.
    Ready(Vec<u8>),
    /// Not all of its records are sealed and checkpointed yet.
    Pending,
    /// No such request of this tenant.
    Unknown,
}

/// Why a proof could not be served.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ProofsError(pub String);

/// The node's signed promise of an ended request's records.
#[derive(Debug, Clone, PartialEq)]
pub enum Promised {
    Signed {
        promise: custody_audit::promise::Promise,
        /// The promise as a signed note (what a verifier checks).
        note: Vec<u8>,
    },
    /// No promise can be made, and why (said in the answer, never silently left out).
    Unavailable(String),
}

/// A log's proofs: a node's own root (implemented by the binary), or a pair's or fleet's nodes
/// asked over gRPC ([`RemoteProofs`]). `node`: whose log (a colocated node has only its own).
/// Every call blocks: callers run them on the blocking pool.
pub trait AuditProofs: Send + Sync + std::fmt::Debug {
    /// The signed promise of `request`'s records, once it has ended (each request once).
    fn promise(&self, tenant: &str, request: u64) -> Result<Promised, ProofsError>;
    /// A pair's or fleet's nodes' promises of a request the front ended itself (asked once it
    /// told them how): prefill node `node`'s of its request `request`, and its decode node's.
    /// A node's own log has none to give here (`promise` answers for it).
    fn node_promises(
        &self,
        _tenant: &str,
        _node: u32,
        _request: u64,
    ) -> Result<Vec<NodePromise>, ProofsError> {
        Ok(Vec::new())
    }
    fn receipt(&self, tenant: &str, node: u32, request: u64) -> Result<Receipt, ProofsError>;
    fn checkpoint(&self, node: u32) -> Result<Vec<u8>, ProofsError>;
    fn consistency(&self, node: u32, old: u64) -> Result<Vec<u8>, ProofsError>;
    /// Record `seq`'s inclusion proof to the node's (cosigned) checkpoint, hashes only (C2SP
    /// `tlog-proof@v1` without `extra`: no record bytes, any tenant may ask).
    fn inclusion(&self, node: u32, seq: u64) -> Result<Vec<u8>, ProofsError>;
}

/// A node's promise as a pair's final event carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePromise {
    pub node: u32,
    /// The request's id on that node.
    pub request: u64,
    /// The signed note (empty when `error` says why there is none).
    pub note: Vec<u8>,
    pub error: String,
}

impl NodePromise {
    pub fn from_proto(p: &proto::ReceiptPromise) -> Self {
        Self {
            node: p.node,
            request: p.request,
            note: p.note.clone(),
            error: p.error.clone(),
        }
    }
}

/// The proofs of a pair's or fleet's nodes, asked through their prefill nodes' front doors
/// (`Prefill.Proof`; a decode node's by any prefill node paired with it).
#[derive(Debug, Clone)]
pub struct RemoteProofs {
    /// Prefill nodes by node id.
    prefill: Vec<(u32, PrefillClient<Channel>)>,
    rt: tokio::runtime::Handle,
}

/// How long a front waits for a node's proof.
const REMOTE_PROOF_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

impl RemoteProofs {
    /// Over `prefill` (node id, its front door); on the current runtime.
    pub fn new(prefill: Vec<(u32, PrefillClient<Channel>)>) -> Self {
        Self {
            prefill,
            rt: tokio::runtime::Handle::current(),
        }
    }

    /// `req` answered by the node it names: its own prefill node if it is one, else the first
    /// prefill node that knows it (a decode peer).
    fn ask(&self, req: proto::ProofRequest) -> Result<proto::ProofReply, ProofsError> {
        let own = self.prefill.iter().filter(|(n, _)| *n == req.node);
        let others = self.prefill.iter().filter(|(n, _)| *n != req.node);
        let mut last = format!("no prefill node knows node {}", req.node);
        for (node, client) in own.chain(others) {
            let mut c = client.clone();
            let asked = self.rt.block_on(async {
                tokio::time::timeout(REMOTE_PROOF_TIMEOUT, c.proof(req.clone())).await
            });
            match asked {
                Ok(Ok(r)) => return Ok(r.into_inner()),
                Ok(Err(s)) if s.code() == tonic::Code::NotFound => last = s.message().to_owned(),
                Ok(Err(s)) => {
                    return Err(ProofsError(format!("prefill node {node}: {}", s.message())));
                }
                Err(_) => {
                    return Err(ProofsError(format!(
                        "prefill node {node}: no answer in {REMOTE_PROOF_TIMEOUT:?}"
                    )));
                }
            }
        }
        Err(ProofsError(last))
    }

    fn body(&self, req: proto::ProofRequest) -> Result<Vec<u8>, ProofsError> {
        let r = self.ask(req)?;
        if r.status == 200 {
            Ok(r.body)
        } else {
            Err(ProofsError(String::from_utf8_lossy(&r.body).into_owned()))
        }
    }
}

fn proof_request(
    tenant: &str,
    node: u32,
    what: &str,
    request: u64,
    old: u64,
) -> proto::ProofRequest {
    proto::ProofRequest {
        tenant: tenant.to_owned(),
        node,
        what: what.to_owned(),
        request,
        old,
    }
}

impl AuditProofs for RemoteProofs {
    fn promise(&self, _tenant: &str, _request: u64) -> Result<Promised, ProofsError> {
        Ok(Promised::Unavailable(
            "the pair's nodes gave no promise in the final event (the front ended the request: a stop sequence, or its client left; or they keep no log): fetch the receipt once sealed".into(),
        ))
    }

    fn node_promises(
        &self,
        tenant: &str,
        node: u32,
        request: u64,
    ) -> Result<Vec<NodePromise>, ProofsError> {
        let r = self.ask(proof_request(tenant, node, proofs::PROMISES, request, 0))?;
        Ok(r.promises.iter().map(NodePromise::from_proto).collect())
    }

    fn receipt(&self, tenant: &str, node: u32, request: u64) -> Result<Receipt, ProofsError> {
        let r = self.ask(proof_request(tenant, node, proofs::RECEIPT, request, 0))?;
        Ok(match r.status {
            200 => Receipt::Ready(r.body),
            202 => Receipt::Pending,
            404 => Receipt::Unknown,
            _ => return Err(ProofsError(String::from_utf8_lossy(&r.body).into_owned())),
        })
    }

    fn checkpoint(&self, node: u32) -> Result<Vec<u8>, ProofsError> {
        self.body(proof_request("", node, proofs::CHECKPOINT, 0, 0))
    }

    fn consistency(&self, node: u32, old: u64) -> Result<Vec<u8>, ProofsError> {
        self.body(proof_request("", node, proofs::CONSISTENCY, 0, old))
    }

    fn inclusion(&self, node: u32, seq: u64) -> Result<Vec<u8>, ProofsError> {
        self.body(proof_request("", node, proofs::INCLUSION, seq, 0))
    }
}

fn unavailable(e: &ProofsError) -> Response {
    ApiError::unavailable(format!("audit proofs: {e}"), "audit_proofs_unavailable").into_response()
}

fn text(body: Vec<u8>) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

/// Runs `f` on the blocking pool (it reads the audit root) once the caller is a tenant and the
/// node keeps proofs.
async fn with_proofs<T: Send + 'static>(
    st: &AppState,
    headers: &HeaderMap,
    f: impl FnOnce(Arc<dyn AuditProofs>, Arc<str>) -> T + Send + 'static,
) -> Result<T, Response> {
    let tenant = st
        .tenants
        .authenticate(headers.get(header::AUTHORIZATION))
        .map_err(IntoResponse::into_response)?;
    let Some(p) = st.proofs.clone() else {
        return Err(ApiError::not_found(
            "this node keeps no audit log to prove from (--no-audit, or in front of a pair: ask the pair's nodes)",
        )
        .into_response());
    };
    let id = tenant.id.clone();
    tokio::task::spawn_blocking(move || f(p, id))
        .await
        .map_err(|e| ApiError::internal(e.to_string(), "audit_proofs_failed").into_response())
}

pub(crate) async fn receipt(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(request_id): Path<String>,
) -> Response {
    let unknown = || ApiError::not_found(format!("no request {request_id} of yours here"));
    // `req-<node>-<n>`: `n` the request's id in node `node`'s log.
    let Some((node, n)) = request_id
        .strip_prefix("req-")
        .and_then(|r| r.split_once('-'))
        .and_then(|(node, n)| Some((node.parse::<u32>().ok()?, n.parse::<u64>().ok()?)))
    else {
        return unknown().into_response();
    };
    match with_proofs(&st, &headers, move |p, t| p.receipt(&t, node, n)).await {
        Err(r) => r,
        Ok(Err(e)) => unavailable(&e),
        Ok(Ok(Receipt::Ready(json))) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            json,
        )
            .into_response(),
        Ok(Ok(Receipt::Pending)) => (
            StatusCode::ACCEPTED,
            [(header::RETRY_AFTER, "5")],
            axum::Json(serde_json::json!({
                "status": "pending",
                "request_id": request_id,
                "message": "its records are not all sealed and checkpointed yet; ask again after the next seal",
            })),
        )
            .into_response(),
        Ok(Ok(Receipt::Unknown)) => unknown().into_response(),
    }
}

/// `?node=N` of a proof request: whose log (default: this server's node — a pair's front: its
/// prefill node).
fn node_param(st: &AppState, uri: &Uri) -> Result<u32, ApiError> {
    match query_param(uri, "node") {
        None => Ok(st.node),
        Some(v) => v
            .parse()
            .map_err(|_| ApiError::bad_request(format!("node={v}: not a node id")).param("node")),
    }
}

fn query_param<'a>(uri: &'a Uri, name: &str) -> Option<&'a str> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

pub(crate) async fn checkpoint(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let node = match node_param(&st, &uri) {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    match with_proofs(&st, &headers, move |p, _| p.checkpoint(node)).await {
        Err(r) => r,
        Ok(Ok(note)) => text(note),
        Ok(Err(e)) => unavailable(&e),
    }
}

pub(crate) async fn consistency(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let node = match node_param(&st, &uri) {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    let old = query_param(&uri, "old").and_then(|v| v.parse::<u64>().ok());
    let Some(old) = old else {
        return ApiError::bad_request("give ?old=<size of the checkpoint you hold>")
            .param("old")
            .into_response();
    };
    match with_proofs(&st, &headers, move |p, _| p.consistency(node, old)).await {
        Err(r) => r,
        Ok(Ok(body)) => text(body),
        Ok(Err(e)) => ApiError::bad_request(e.to_string()).into_response(),
    }
}

/// One request of an answer: the engine's id, its `x-request-id`, and the promises its final
/// event carried (a pair's nodes').
#[derive(Debug, Clone)]
pub(crate) struct AnsweredRequest {
    pub id: u64,
    pub rid: String,
    pub promises: Vec<NodePromise>,
}

/// The `custody_receipt` object of an answer covering `requests` (ended, their records all
/// recorded): per request its fetch path and the node's signed promise of its records, or why
/// there is none. `None` where the node keeps no proofs (no log, or a pair's front).
pub(crate) async fn custody_receipt(
    st: &AppState,
    tenant: &Arc<str>,
    requests: &[AnsweredRequest],
) -> Option<serde_json::Value> {
    let proofs = st.proofs.clone()?;
    let mut out = Vec::with_capacity(requests.len());
    for r in requests {
        if !r.promises.is_empty() {
            out.extend(r.promises.iter().map(carried_entry));
            continue;
        }
        // A pair's request the front ended itself: its nodes' promises, asked now.
        if let Some(node) = node_of(&r.rid) {
            let (p, t, id) = (proofs.clone(), tenant.clone(), r.id);
            let asked = tokio::task::spawn_blocking(move || p.node_promises(&t, node, id)).await;
            if let Ok(Ok(carried)) = asked
                && !carried.is_empty()
            {
                out.extend(carried.iter().map(carried_entry));
                continue;
            }
        }
        let (p, t, id) = (proofs.clone(), tenant.clone(), r.id);
        let got = tokio::task::spawn_blocking(move || p.promise(&t, id)).await;
        let outcome = match got {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => Promised::Unavailable(e.to_string()),
            Err(e) => Promised::Unavailable(e.to_string()),
        };
        out.push(entry(st.node, &r.rid, outcome));
    }
    Some(serde_json::json!({
        "format": PROMISE_RECEIPT_FORMAT,
        "node": st.node,
        "requests": out,
    }))
}

/// The node of a request id `req-<node>-<n>`.
fn node_of(rid: &str) -> Option<u32> {
    rid.strip_prefix("req-")?.split_once('-')?.0.parse().ok()
}

/// One node's entry of an answer's `custody_receipt`.
fn entry(node: u32, rid: &str, outcome: Promised) -> serde_json::Value {
    let mut v = serde_json::json!({
        "node": node,
        "request_id": rid,
        "fetch": format!("/v1/audit/receipt/{rid}"),
    });
    match outcome {
        Promised::Signed { promise, note } => {
            v["origin"] = promise.origin.into();
            v["records"] = promise
                .leaves
                .iter()
                .map(|l| serde_json::json!({"seq": l.seq, "table": l.table, "leaf": l.leaf_base64()}))
                .collect();
            v["promise"] = String::from_utf8_lossy(&note).into_owned().into();
        }
        Promised::Unavailable(why) => v["error"] = why.into(),
    }
    v
}

/// The entry of a promise a pair's node gave (its signature is the tenant's verifier's to
/// check; here it is only read for the records it lists).
fn carried_entry(p: &NodePromise) -> serde_json::Value {
    let rid = format!("req-{}-{}", p.node, p.request);
    let outcome = if !p.error.is_empty() {
        Promised::Unavailable(p.error.clone())
    } else {
        match custody_audit::promise::Promise::of_note(&p.note) {
            Ok(promise) => Promised::Signed {
                promise,
                note: p.note.clone(),
            },
            Err(e) => {
                Promised::Unavailable(format!("node {} sent a malformed promise: {e}", p.node))
            }
        }
    };
    entry(p.node, &rid, outcome)
}

/// The `format` of an answer's `custody_receipt`.
pub const PROMISE_RECEIPT_FORMAT: &str = "custody-receipt-promise/1";

/// `GET /v1/audit/proof/inclusion?seq=S[&node=N]`: record `seq`'s inclusion proof, hashes only —
/// what a tenant holds a promised leaf to, even where the node no longer serves the receipt.
pub(crate) async fn inclusion(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    uri: Uri,
) -> Response {
    let node = match node_param(&st, &uri) {
        Ok(n) => n,
        Err(e) => return e.into_response(),
    };
    let Some(seq) = query_param(&uri, "seq").and_then(|v| v.parse::<u64>().ok()) else {
        return ApiError::bad_request("give ?seq=<the record's sequence number>")
            .param("seq")
            .into_response();
    };
    match with_proofs(&st, &headers, move |p, _| p.inclusion(node, seq)).await {
        Err(r) => r,
        Ok(Ok(body)) => text(body),
        Ok(Err(e)) => ApiError::not_found(e.to_string()).into_response(),
    }
}

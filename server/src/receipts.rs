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
    Unavailable(&'static str),
}

/// The node's proofs, over its audit root (implemented by the binary).
pub trait AuditProofs: Send + Sync + std::fmt::Debug {
    /// The signed promise of `request`'s records, once it has ended (each request once).
    fn promise(&self, tenant: &str, request: u64) -> Result<Promised, ProofsError>;
    fn receipt(&self, tenant: &str, request: u64) -> Result<Receipt, ProofsError>;
    fn checkpoint(&self) -> Result<Vec<u8>, ProofsError>;
    fn consistency(&self, old: u64) -> Result<Vec<u8>, ProofsError>;
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
    let unknown = || ApiError::not_found(format!("no request {request_id} of yours on this node"));
    let Some(n) = request_id
        .strip_prefix(&format!("req-{}-", st.node))
        .and_then(|n| n.parse::<u64>().ok())
    else {
        return unknown().into_response();
    };
    match with_proofs(&st, &headers, move |p, t| p.receipt(&t, n)).await {
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

pub(crate) async fn checkpoint(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    match with_proofs(&st, &headers, |p, _| p.checkpoint()).await {
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
    let old = uri
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("old="))
        .and_then(|v| v.parse::<u64>().ok());
    let Some(old) = old else {
        return ApiError::bad_request("give ?old=<size of the checkpoint you hold>")
            .param("old")
            .into_response();
    };
    match with_proofs(&st, &headers, move |p, _| p.consistency(old)).await {
        Err(r) => r,
        Ok(Ok(body)) => text(body),
        Ok(Err(e)) => ApiError::bad_request(e.to_string()).into_response(),
    }
}

/// One request of an answer: the engine's id and its `x-request-id`.
#[derive(Debug, Clone)]
pub(crate) struct AnsweredRequest {
    pub id: u64,
    pub rid: String,
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
        let (p, t, id) = (proofs.clone(), tenant.clone(), r.id);
        let got = tokio::task::spawn_blocking(move || p.promise(&t, id)).await;
        let mut v = serde_json::json!({
            "request_id": r.rid,
            "fetch": format!("/v1/audit/receipt/{}", r.rid),
        });
        match got {
            Ok(Ok(Promised::Signed { promise, note })) => {
                v["origin"] = promise.origin.into();
                v["records"] = promise
                    .leaves
                    .iter()
                    .map(|l| serde_json::json!({"seq": l.seq, "table": l.table, "leaf": l.leaf_base64()}))
                    .collect();
                v["promise"] = String::from_utf8_lossy(&note).into_owned().into();
            }
            Ok(Ok(Promised::Unavailable(why))) => v["error"] = why.into(),
            Ok(Err(e)) => v["error"] = e.to_string().into(),
            Err(e) => v["error"] = e.to_string().into(),
        }
        out.push(v);
    }
    Some(serde_json::json!({
        "format": PROMISE_RECEIPT_FORMAT,
        "node": st.node,
        "requests": out,
    }))
}

/// The `format` of an answer's `custody_receipt`.
pub const PROMISE_RECEIPT_FORMAT: &str = "custody-receipt-promise/1";

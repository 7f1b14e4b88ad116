//! `custody witness`'s HTTP face: C2SP `tlog-witness` over [`custody_audit::tlog_witness`].
//!
//! - `POST /add-checkpoint`: the spec's request and statuses; `200` with the cosignature line.
//! - `GET /<hex sha256(origin)>/checkpoint`: the newest checkpoint it cosigned (the spec's
//!   monitoring endpoint); 404 if none.
//!
//! The witness's check and update run on the blocking pool (they fsync).

use std::future::Future;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use custody_audit::tlog_witness::Witness;

use crate::ServeError;

use std::time::Duration;

use custody_audit::tlog_witness::{HttpReply, TransportError, WitnessTransport};

/// A request body past this is refused (a checkpoint note is at most a few KiB; 63 proof
/// lines ~3 KiB).
const MAX_BODY_BYTES: usize = 64 << 10;

/// The witness's routes.
pub fn router(w: Arc<Witness>) -> Router {
    Router::new()
        .route("/add-checkpoint", post(add_checkpoint))
        .route("/{origin_id}/checkpoint", get(latest))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(w)
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_secs())
}

async fn add_checkpoint(State(w): State<Arc<Witness>>, body: Bytes) -> Response {
    let r = tokio::task::spawn_blocking(move || w.add_checkpoint(&body, now_s())).await;
    match r {
        Ok(Ok(lines)) => (StatusCode::OK, lines).into_response(),
        Ok(Err(e)) => {
            let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
            let ctype = if status == StatusCode::CONFLICT {
                "text/x.tlog.size"
            } else {
                "text/plain; charset=utf-8"
            };
            tracing::info!(status = status.as_u16(), error = %e, "add-checkpoint refused");
            (status, [(header::CONTENT_TYPE, ctype)], e.body()).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn latest(State(w): State<Arc<Witness>>, Path(origin_id): Path<String>) -> Response {
    let r = tokio::task::spawn_blocking(move || w.latest_by_id(&origin_id)).await;
    match r {
        Ok(Ok(Some(note))) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            note,
        )
            .into_response(),
        Ok(Ok(None)) => (StatusCode::NOT_FOUND, "no checkpoint cosigned\n").into_response(),
        Ok(Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Serves the witness on `listener` until `shutdown`.
pub async fn serve_witness(
    listener: tokio::net::TcpListener,
    w: Arc<Witness>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let addr = listener.local_addr()?;
    tracing::info!(%addr, vkey = %w.vkey(), "tlog witness serving");
    axum::serve(listener, router(w))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// Read and write timeout of one `add-checkpoint` (a witness answers in well under a second;
/// a hung one must not hold the node's cosigning round).
const TIMEOUT: Duration = Duration::from_secs(5);

/// `POST` over plain HTTP/1.1 (`crate::client`), for a node reaching its witnesses.
#[derive(Debug, Default)]
pub struct HttpTransport;

impl WitnessTransport for HttpTransport {
    fn post(&self, url: &str, body: &[u8]) -> Result<HttpReply, TransportError> {
        let err = |why: String| TransportError {
            url: url.to_owned(),
            why,
        };
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| err("only http:// witnesses are supported".into()))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let r = crate::client::request(
            &format!("http://{authority}"),
            "POST",
            path,
            None,
            Some(body),
            TIMEOUT,
        )
        .map_err(|e| err(e.to_string()))?;
        Ok(HttpReply {
            status: r.status,
            body: r.body,
        })
    }
}

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

use std::io::{Read as _, Write as _};
use std::net::{TcpStream, ToSocketAddrs as _};
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

/// Connect, write and read timeouts of one `add-checkpoint` (a witness on the other side of a
/// WAN answers in well under a second; a hung one must not hold the round).
const TIMEOUT: Duration = Duration::from_secs(5);
/// A witness's reply past this is malformed (a few cosignature lines).
const MAX_REPLY_BYTES: u64 = 64 << 10;

/// `POST` over plain HTTP/1.1, `Connection: close`.
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
        let (host, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let addr = host
            .to_socket_addrs()
            .map_err(|e| err(e.to_string()))?
            .next()
            .ok_or_else(|| err("no address".into()))?;
        let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| err(e.to_string()))?;
        let io = |e: std::io::Error| err(e.to_string());
        s.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
        s.set_write_timeout(Some(TIMEOUT)).map_err(io)?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).map_err(io)?;
        s.write_all(body).map_err(io)?;
        let mut raw = Vec::new();
        s.take(MAX_REPLY_BYTES).read_to_end(&mut raw).map_err(io)?;
        parse_reply(&raw).map_err(|why| err(why.into()))
    }
}

/// Status and body of an HTTP/1.1 response read to its end (`Content-Length` or chunked).
fn parse_reply(raw: &[u8]) -> Result<HttpReply, &'static str> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "headers are not UTF-8")?;
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status")?;
    let body = &raw[end + 4..];
    let chunked = head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.contains("chunked"));
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(HttpReply { status, body })
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::new();
    // Each round consumes a chunk's size line: bounded by the body's length.
    loop {
        let nl = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a torn chunk")?;
        let size = usize::from_str_radix(
            std::str::from_utf8(&b[..nl])
                .map_err(|_| "a chunk size")?
                .trim(),
            16,
        )
        .map_err(|_| "a chunk size")?;
        b = &b[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err("a torn chunk");
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

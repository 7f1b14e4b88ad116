//! Kubernetes-style health endpoints of a node: `GET /health/live` (the process answers) and
//! `GET /health/ready` (it takes new requests: not draining, and what it needs is up — a prefill
//! node's decode peers, a decode node's engine). Plain HTTP/1.1 on a port of its own
//! (`[disagg] health_listen`), answered by one thread: a probe must work when the gRPC side is
//! wedged, and it reads nothing but the node's own flags.

use crate::transport::Discard;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// Whether the node takes new requests, and if not why (the body of a 503).
pub type Readiness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// A probe's request line and headers, at most this many bytes (anything longer is refused).
const REQUEST_MAX_BYTES: usize = 4096;
/// A probe that does not send its request within this is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Serve the two endpoints on `listener` until the process exits (a detached thread).
pub fn spawn(listener: TcpListener, ready: Readiness) -> std::io::Result<()> {
    spawn_degraded(listener, ready, None)
}

/// [`spawn`], with what the node serves without (`Some`: a ready answer says
/// `ready, degraded: <it>` — a node run with `--no-audit` says `audit disabled`).
pub fn spawn_degraded(
    listener: TcpListener,
    ready: Readiness,
    degraded: Option<&'static str>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("health".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => answer(s, &ready, degraded),
                    Err(e) => {
                        tracing::warn!(error = %e, "health endpoint: accept failed");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        })?;
    Ok(())
}

fn answer(mut s: TcpStream, ready: &Readiness, degraded: Option<&str>) {
    s.set_read_timeout(Some(READ_TIMEOUT))
        .discard("without the timeout a silent client only holds this probe thread longer");
    let mut buf = [0u8; REQUEST_MAX_BYTES];
    let mut n = 0;
    // Bounded: at most REQUEST_MAX_BYTES bytes, each read within READ_TIMEOUT.
    while n < buf.len() {
        match s.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let line = std::str::from_utf8(&buf[..n])
        .unwrap_or("")
        .lines()
        .next()
        .unwrap_or("");
    let (status, body) = route(line, ready, degraded);
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(reply.as_bytes())
        .discard("the prober may hang up before reading the answer");
}

fn route(line: &str, ready: &Readiness, degraded: Option<&str>) -> (&'static str, String) {
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" {
        return ("405 Method Not Allowed", "GET only\n".into());
    }
    match path {
        "/health/live" => ("200 OK", "live\n".into()),
        "/health/ready" => match ready() {
            Ok(()) => match degraded {
                None => ("200 OK", "ready\n".into()),
                Some(d) => ("200 OK", format!("ready, degraded: {d}\n")),
            },
            Err(why) => ("503 Service Unavailable", format!("not ready: {why}\n")),
        },
        _ => (
            "404 Not Found",
            "try /health/live or /health/ready\n".into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).expect("connect");
        write!(s, "GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    }

    /// Live always answers; ready follows the node's own readiness, with the reason in a 503.
    #[test]
    fn live_and_ready_answer_as_the_node_says() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = flag.clone();
        let ready: Readiness = Arc::new(move || {
            if f.load(std::sync::atomic::Ordering::SeqCst) {
                Err("draining".into())
            } else {
                Ok(())
            }
        });
        spawn(l, ready).expect("spawn");
        assert!(get(addr, "/health/live").starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/health/ready").starts_with("HTTP/1.1 200"));
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        let r = get(addr, "/health/ready");
        assert!(
            r.starts_with("HTTP/1.1 503") && r.contains("draining"),
            "{r}"
        );
        assert!(get(addr, "/health/live").starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/nope").starts_with("HTTP/1.1 404"));
    }

    /// A node serving without its audit log is ready, and says what it lacks.
    #[test]
    fn a_degraded_node_is_ready_and_says_so() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        spawn_degraded(l, Arc::new(|| Ok(())), Some("audit disabled")).expect("spawn");
        let r = get(addr, "/health/ready");
        assert!(
            r.starts_with("HTTP/1.1 200") && r.contains("ready, degraded: audit disabled"),
            "{r}"
        );
    }
}

//! A minimal blocking HTTP/1.1 client (one request per connection, `Connection: close`) for
//! `custody validate` and the tests: enough for JSON over loopback or a private network,
//! without linking a second HTTP client stack. No TLS.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::canary::{Golden, Report};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("unsupported URL {0:?}: expected http://host:port (no TLS)")]
    Url(String),
    #[error("I/O with {addr}: {source}")]
    Io {
        addr: String,
        source: std::io::Error,
    },
    #[error("malformed HTTP response: {0}")]
    Malformed(String),
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
}

/// A response: status, headers (lowercased names), body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// `http://host:port[/]` → `host:port`.
fn authority(base: &str) -> Result<String, ClientError> {
    let rest = base
        .strip_prefix("http://")
        .ok_or_else(|| ClientError::Url(base.into()))?;
    let a = rest.trim_end_matches('/');
    if a.is_empty() || a.contains('/') {
        return Err(ClientError::Url(base.into()));
    }
    Ok(a.to_owned())
}

/// One request; `body` is sent as JSON when given.
pub fn request(
    base: &str,
    method: &str,
    path: &str,
    api_key: Option<&str>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<Response, ClientError> {
    let addr = authority(base)?;
    let io = |source| ClientError::Io {
        addr: addr.clone(),
        source,
    };
    let mut s = TcpStream::connect(&addr).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(k) = api_key {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).map_err(io)?;
    if let Some(b) = body {
        s.write_all(b).map_err(io)?;
    }
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(io)?;
    parse(&raw)
}

fn parse(raw: &[u8]) -> Result<Response, ClientError> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| ClientError::Malformed("no end of headers".into()))?;
    let head = std::str::from_utf8(&raw[..end])
        .map_err(|_| ClientError::Malformed("headers are not UTF-8".into()))?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| ClientError::Malformed("bad status line".into()))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[end + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        body = dechunk(&body)?;
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, ClientError> {
    let bad = || ClientError::Malformed("bad chunked encoding".into());
    let mut out = Vec::new();
    // Bounded by the input: every iteration consumes at least the size line.
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n").ok_or_else(bad)?;
        let size_s = std::str::from_utf8(&b[..nl]).map_err(|_| bad())?;
        let size = usize::from_str_radix(size_s.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| bad())?;
        b = &b[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err(bad());
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// Run the golden prompts through a server's `/v1/completions` (greedy, as token ids, asking
/// for the output token ids) and compare each with its reference, token for token.
pub fn validate(base: &str, api_key: &str, golden: &[Golden]) -> Result<Report, ClientError> {
    let mut report = Report {
        checked: 0,
        mismatches: Vec::new(),
    };
    for g in golden {
        let body = serde_json::json!({
            "prompt": g.prompt,
            "max_tokens": g.max_tokens,
            "temperature": 0,
            "custody_token_ids": true,
        })
        .to_string();
        let r = request(
            base,
            "POST",
            "/v1/completions",
            Some(api_key),
            Some(body.as_bytes()),
            Duration::from_secs(300),
        )?;
        let got = if r.status == 200 {
            let v: serde_json::Value = serde_json::from_slice(&r.body)
                .map_err(|e| ClientError::Malformed(format!("response body: {e}")))?;
            let ids = v["choices"][0]["token_ids"]
                .as_array()
                .ok_or_else(|| {
                    ClientError::Malformed(
                        "no choices[0].token_ids in the response: is this a custody server?".into(),
                    )
                })?
                .iter()
                .map(|x| x.as_u64().map(|t| t as u32))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| ClientError::Malformed("token_ids must be integers".into()))?;
            Ok(ids)
        } else if r.status == 401 {
            return Err(ClientError::Status {
                status: r.status,
                body: String::from_utf8_lossy(&r.body).into_owned(),
            });
        } else {
            Err(format!(
                "HTTP {}: {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            ))
        };
        report.add(g, got);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_responses() {
        let r = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Request-Id: a\r\n\r\nhi")
            .expect("parse");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-request-id"), Some("a"));
        assert_eq!(r.body, b"hi");
        let r = parse(b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            .expect("chunked");
        assert_eq!(r.body, b"abcde");
        assert!(authority("https://x").is_err());
        assert_eq!(
            authority("http://127.0.0.1:8080/").expect("url"),
            "127.0.0.1:8080"
        );
    }
}

//! Tenants: API keys (stored as SHA-256 hashes), and per-tenant concurrency and token-rate
//! limits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::TenantSection;
use axum::http::HeaderValue;
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

/// The SHA-256 of an API key, lowercase hex: what the config stores.
pub fn hash_key(key: &str) -> String {
    let d = Sha256::digest(key.as_bytes());
    let mut s = String::with_capacity(64);
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// A fresh random API key (`sk-custody-` + 32 hex characters from the OS's random source).
pub fn generate_key() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!("sk-custody-{hex}"))
}

/// Token bucket: `capacity` tokens, refilled continuously at `capacity` per minute.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

/// One tenant and its limits.
#[derive(Debug)]
pub struct Tenant {
    pub id: Arc<str>,
    sem: Arc<Semaphore>,
    pub max_concurrent: usize,
    /// 0 = unlimited.
    pub tokens_per_minute: u64,
    bucket: Mutex<Bucket>,
}

impl Tenant {
    fn new(t: &TenantSection) -> Self {
        Self {
            id: t.id.as_str().into(),
            sem: Arc::new(Semaphore::new(t.max_concurrent)),
            max_concurrent: t.max_concurrent,
            tokens_per_minute: t.tokens_per_minute,
            bucket: Mutex::new(Bucket {
                tokens: t.tokens_per_minute as f64,
                last: Instant::now(),
            }),
        }
    }

    /// A concurrency slot, held for the request's life (released on drop).
    pub fn try_acquire(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.sem.clone().try_acquire_owned().map_err(|_| {
            ApiError::rate_limited(
                format!(
                    "tenant {} already has {} requests in flight (its max_concurrent); retry when one finishes",
                    self.id, self.max_concurrent
                ),
                1,
            )
        })
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.max_concurrent - self.sem.available_permits()
    }

    fn refill(&self, b: &mut Bucket) {
        let now = Instant::now();
        let per_s = self.tokens_per_minute as f64 / 60.0;
        b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * per_s)
            .min(self.tokens_per_minute as f64);
        b.last = now;
    }

    /// Charge `tokens` (prompt + max_tokens) against the per-minute budget.
    pub fn charge(&self, tokens: u64) -> Result<(), ApiError> {
        if self.tokens_per_minute == 0 {
            return Ok(());
        }
        if tokens > self.tokens_per_minute {
            return Err(ApiError::rate_limited(
                format!(
                    "request of {tokens} tokens (prompt + max_tokens) exceeds tenant {}'s budget of {} tokens per minute; lower max_tokens or the prompt",
                    self.id, self.tokens_per_minute
                ),
                60,
            ));
        }
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut b);
        let need = tokens as f64;
        if b.tokens >= need {
            b.tokens -= need;
            return Ok(());
        }
        let per_s = self.tokens_per_minute as f64 / 60.0;
        let wait_s = ((need - b.tokens) / per_s).ceil() as u64;
        Err(ApiError::rate_limited(
            format!(
                "tenant {} is over its budget of {} tokens per minute ({} tokens requested, {:.0} available); retry in {wait_s} s",
                self.id, self.tokens_per_minute, tokens, b.tokens
            ),
            wait_s,
        ))
    }

    /// Give back tokens charged but not used (output shorter than max_tokens).
    pub fn refund(&self, tokens: u64) {
        if self.tokens_per_minute == 0 || tokens == 0 {
            return;
        }
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut b);
        b.tokens = (b.tokens + tokens as f64).min(self.tokens_per_minute as f64);
    }
}

/// Every tenant, by key hash.
#[derive(Debug)]
pub struct Tenants {
    by_hash: HashMap<String, Arc<Tenant>>,
    pub all: Vec<Arc<Tenant>>,
}

impl Tenants {
    pub fn new(cfg: &[TenantSection]) -> Self {
        let mut by_hash = HashMap::new();
        let mut all = Vec::new();
        for t in cfg {
            let tenant = Arc::new(Tenant::new(t));
            for h in &t.keys_sha256 {
                by_hash.insert(h.clone(), tenant.clone());
            }
            all.push(tenant);
        }
        Self { by_hash, all }
    }

    /// The tenant of an `Authorization: Bearer <key>` header. Keys are compared by hash, so
    /// the lookup's timing depends on the hash, not on the key's bytes.
    pub fn authenticate(&self, header: Option<&HeaderValue>) -> Result<Arc<Tenant>, ApiError> {
        let Some(h) = header else {
            return Err(ApiError::unauthorized(
                "no API key provided: send it as 'Authorization: Bearer <key>'",
            ));
        };
        let key = h
            .to_str()
            .ok()
            .and_then(|s| {
                s.strip_prefix("Bearer ")
                    .or_else(|| s.strip_prefix("bearer "))
            })
            .map(str::trim)
            .ok_or_else(|| {
                ApiError::unauthorized("malformed Authorization header: expected 'Bearer <key>'")
            })?;
        self.by_hash
            .get(&hash_key(key))
            .cloned()
            .ok_or_else(|| ApiError::unauthorized("incorrect API key provided"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(tpm: u64, conc: usize) -> TenantSection {
        TenantSection {
            id: "acme".into(),
            keys_sha256: vec![hash_key("k1")],
            max_concurrent: conc,
            tokens_per_minute: tpm,
        }
    }

    #[test]
    fn hash_is_sha256_hex() {
        // SHA-256("abc"), FIPS 180-2 test vector.
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn authenticates_by_hash_only() {
        let ts = Tenants::new(&[tenant(0, 1)]);
        let ok = HeaderValue::from_static("Bearer k1");
        assert_eq!(&*ts.authenticate(Some(&ok)).expect("auth").id, "acme");
        for bad in ["Bearer k2", "k1", "Basic k1", "Bearer "] {
            let h = HeaderValue::from_static(bad);
            assert_eq!(
                ts.authenticate(Some(&h)).expect_err(bad).status,
                axum::http::StatusCode::UNAUTHORIZED
            );
        }
        assert!(ts.authenticate(None).is_err());
    }

    #[test]
    fn concurrency_and_token_limits() {
        let ts = Tenants::new(&[tenant(600, 1)]);
        let t = &ts.all[0];
        let p = t.try_acquire().expect("first slot");
        assert!(
            t.try_acquire().is_err(),
            "second concurrent request refused"
        );
        drop(p);
        assert!(t.try_acquire().is_ok());
        t.charge(500).expect("within budget");
        let e = t.charge(200).expect_err("over budget");
        assert_eq!(e.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
        assert!(e.retry_after_s.unwrap_or(0) >= 1);
        t.refund(300);
        t.charge(200).expect("refund restored budget");
        assert!(t.charge(601).is_err(), "larger than the whole budget");
    }
}

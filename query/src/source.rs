//! Where an audit root is: a local directory or an object-store URL (`s3://bucket/prefix`).
//!
//! [`ObjectLogStore`] is the [`LogStore`] through which `custody-audit`'s verification reads an
//! object store: every digest is read, and every sealed object hashed, through it (no local
//! copy). The audit crate stays synchronous and knows nothing of object stores; this adapter
//! blocks on the async client, so it is used from a blocking thread (see
//! [`crate::open_session`]).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use custody_audit::digest::{LogStore, StoreError, hex};
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, ObjectStoreExt, RetryConfig};
use sha2::{Digest as _, Sha256};

use crate::QueryError;

/// An audit root as the user names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuditRoot {
    /// A directory (also `file:///dir`).
    Local(PathBuf),
    /// `s3://<bucket>[/<prefix>]`; `prefix` has no leading or trailing `/` (empty: the bucket's
    /// top).
    S3 { bucket: String, prefix: String },
}

impl AuditRoot {
    /// A directory path, `file:///dir`, or `s3://bucket[/prefix]`; any other `scheme://` is an
    /// error (not silently taken for a relative directory).
    pub fn parse(s: &str) -> Result<Self, QueryError> {
        let bad = |why: &str| QueryError::BadRoot(format!("{s}: {why}"));
        if let Some(rest) = s.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            // S3's naming rules, loosely: enough to catch a typo before any request is made.
            let bucket_ok = (3..=63).contains(&bucket.len())
                && bucket.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-'
                });
            if !bucket_ok {
                return Err(bad(
                    "not a valid S3 bucket name (3-63 characters: a-z, 0-9, '.', '-')",
                ));
            }
            let prefix = prefix.trim_matches('/');
            ObjectPath::parse(prefix).map_err(|e| bad(&e.to_string()))?;
            return Ok(Self::S3 {
                bucket: bucket.to_owned(),
                prefix: prefix.to_owned(),
            });
        }
        if let Some(dir) = s.strip_prefix("file://") {
            return Ok(Self::Local(PathBuf::from(dir)));
        }
        if let Some((scheme, _)) = s.split_once("://") {
            return Err(bad(&format!(
                "unsupported scheme {scheme}:// (an audit root is a directory or s3://bucket/prefix)"
            )));
        }
        if s.is_empty() {
            return Err(bad("empty"));
        }
        Ok(Self::Local(PathBuf::from(s)))
    }

    pub fn is_local(&self) -> bool {
        matches!(self, Self::Local(_))
    }
}

impl FromStr for AuditRoot {
    type Err = QueryError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for AuditRoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(p) => write!(f, "{}", p.display()),
            Self::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Self::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

/// Retries for the S3 client: object_store's default (10 over up to 3 minutes) would keep a
/// command against a dead or wrong endpoint waiting for minutes; two quick retries still ride out
/// a transient error. object_store's timeouts stand (5 s to connect, 30 s a request; settable
/// through `AWS_CONNECT_TIMEOUT`/`AWS_TIMEOUT`), so a black-holed endpoint fails within ~15 s.
fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            base: 2.0,
        },
        max_retries: 2,
        retry_timeout: Duration::from_secs(10),
    }
}

/// An S3 client for `bucket`, configured from the usual variables: `AWS_ENDPOINT_URL` (or
/// `AWS_ENDPOINT`), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
/// `AWS_REGION`, and `AWS_ALLOW_HTTP=true` for an `http://` endpoint. Builds no connection.
pub fn s3_store(bucket: &str) -> Result<Arc<dyn ObjectStore>, QueryError> {
    s3_store_with(AmazonS3Builder::from_env(), bucket)
}

/// [`s3_store`] from an explicit configuration, with the same bounded retries.
pub fn s3_store_with(
    builder: AmazonS3Builder,
    bucket: &str,
) -> Result<Arc<dyn ObjectStore>, QueryError> {
    // object_store refuses a plain-HTTP endpoint only at the first request, with a bare
    // "builder error": say what to set instead.
    let endpoint = builder
        .get_config_value(&AmazonS3ConfigKey::Endpoint)
        .unwrap_or_default();
    let allow_http = builder
        .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
        .is_some_and(|v| {
            matches!(
                v.to_ascii_lowercase().as_str(),
                "1" | "true" | "on" | "yes" | "y"
            )
        });
    if endpoint.starts_with("http://") && !allow_http {
        return Err(QueryError::BadRoot(format!(
            "s3://{bucket}: the endpoint {endpoint} is plain HTTP; set AWS_ALLOW_HTTP=true to use it"
        )));
    }
    let s3 = builder
        .with_bucket_name(bucket)
        .with_retry(retry_config())
        .build()?;
    Ok(Arc::new(s3))
}

/// An audit root in an object store, as a [`LogStore`]. Its methods block on `rt`: call them
/// from a blocking thread (`tokio::task::spawn_blocking`), never from async code.
pub struct ObjectLogStore {
    store: Arc<dyn ObjectStore>,
    /// Object path of the root (empty: the bucket's top).
    prefix: String,
    /// The root as a URL, without a trailing `/` (what reports name objects by).
    url: String,
    rt: tokio::runtime::Handle,
}

impl fmt::Debug for ObjectLogStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectLogStore")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl ObjectLogStore {
    pub fn new(
        store: Arc<dyn ObjectStore>,
        prefix: &str,
        url: String,
        rt: tokio::runtime::Handle,
    ) -> Self {
        Self {
            store,
            prefix: prefix.trim_matches('/').to_owned(),
            url: url.trim_end_matches('/').to_owned(),
            rt,
        }
    }

    fn err(&self, rel: &str, e: impl fmt::Display) -> StoreError {
        let rel = rel.trim_matches('/');
        StoreError {
            path: if rel.is_empty() {
                self.url.clone()
            } else {
                format!("{}/{rel}", self.url)
            },
            why: e.to_string(),
        }
    }

    /// The object path of `rel` (relative to the root). Rejects `..`, empty segments and the
    /// like, which a digest could name but no object has.
    fn object(&self, rel: &str) -> Result<ObjectPath, StoreError> {
        let rel = rel.trim_matches('/');
        let full = match (self.prefix.is_empty(), rel.is_empty()) {
            (true, _) => rel.to_owned(),
            (false, true) => self.prefix.clone(),
            (false, false) => format!("{}/{rel}", self.prefix),
        };
        ObjectPath::parse(&full).map_err(|e| self.err(rel, e))
    }
}

impl LogStore for ObjectLogStore {
    fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let base = self.object(prefix)?;
        let listed: Vec<object_store::ObjectMeta> = self
            .rt
            .block_on(
                self.store
                    .list((!base.as_ref().is_empty()).then_some(&base))
                    .try_collect(),
            )
            .map_err(|e| self.err(prefix, e))?;
        let root = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        Ok(listed
            .into_iter()
            .filter_map(|m| m.location.as_ref().strip_prefix(&root).map(str::to_owned))
            .collect())
    }

    fn read(&self, path: &str) -> Result<Vec<u8>, StoreError> {
        let obj = self.object(path)?;
        self.rt
            .block_on(async { self.store.get(&obj).await?.bytes().await })
            .map(|b| b.to_vec())
            .map_err(|e| self.err(path, e))
    }

    /// Streams the object through the hash: a large sealed file is never held whole.
    fn sha256(&self, path: &str) -> Result<(String, u64), StoreError> {
        let obj = self.object(path)?;
        self.rt
            .block_on(async {
                let mut body = self.store.get(&obj).await?.into_stream();
                let mut h = Sha256::new();
                let mut n = 0u64;
                // Ends with the object's last chunk.
                while let Some(chunk) = body.next().await {
                    let chunk = chunk?;
                    h.update(&chunk);
                    n += chunk.len() as u64;
                }
                Ok::<_, object_store::Error>((hex(&h.finalize()), n))
            })
            .map_err(|e| self.err(path, e))
    }

    fn locate(&self, path: &str) -> PathBuf {
        PathBuf::from(format!("{}/{}", self.url, path.trim_start_matches('/')))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_parse_as_directories_or_s3_urls() {
        assert_eq!(
            AuditRoot::parse("/var/audit").expect("dir"),
            AuditRoot::Local("/var/audit".into())
        );
        assert_eq!(
            AuditRoot::parse("file:///var/audit").expect("file url"),
            AuditRoot::Local("/var/audit".into())
        );
        let s3 = AuditRoot::parse("s3://audit-bucket/prod/node-logs/").expect("s3");
        assert_eq!(
            s3,
            AuditRoot::S3 {
                bucket: "audit-bucket".into(),
                prefix: "prod/node-logs".into()
            }
        );
        assert_eq!(s3.to_string(), "s3://audit-bucket/prod/node-logs");
        assert_eq!(
            AuditRoot::parse("s3://audit-bucket")
                .expect("bucket top")
                .to_string(),
            "s3://audit-bucket"
        );
        for bad in [
            "gs://bucket/x",
            "s3://",
            "s3://Bad_Bucket/x",
            "s3://ok-bucket/a//b",
            "s3://ok-bucket/a/../b",
            "",
        ] {
            let e = AuditRoot::parse(bad).expect_err(bad);
            assert!(e.to_string().contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn a_plain_http_endpoint_needs_allow_http() {
        let b = || AmazonS3Builder::new().with_endpoint("http://127.0.0.1:9");
        let Err(e) = s3_store_with(b(), "audit") else {
            panic!("a plain-HTTP endpoint without AWS_ALLOW_HTTP is refused")
        };
        assert!(e.to_string().contains("AWS_ALLOW_HTTP=true"), "{e}");
        assert!(s3_store_with(b().with_allow_http(true), "audit").is_ok());
    }
}

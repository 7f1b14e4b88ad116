//! The object-store tier of KV offload: sealed pages in S3 (`s3://bucket/prefix/<key>.kvpage`),
//! one store a fleet's prefill nodes share. A [`custody_engine::offload::store::PageStore`]: the
//! engine knows no network and no async runtime, so this crate owns a small tokio runtime and
//! blocks on it from the offload worker's thread (and, for a restore its prefetch did not
//! reach, from the engine's).
//!
//! The bucket is not trusted: every page read from it is opened by
//! [`custody_engine::offload::seal::open`] (MAC, model, geometry, chain key, namespace), and
//! with `encrypt_key_file` it holds only ciphertext.

use std::sync::Arc;
use std::time::Duration;

use custody_engine::offload::store::{PageStore, StoreError, Stored, Tier};
use custody_engine::prefix_cache::BlockKey;
use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientConfigKey, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
};

/// The object tier could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum S3TierError {
    #[error("kv_offload.object_url {0}: expected s3://bucket[/prefix]")]
    Url(String),
    #[error(
        "kv_offload.object_url {url}: the endpoint {endpoint} is plain HTTP; set AWS_ALLOW_HTTP=true to use it"
    )]
    PlainHttp { url: String, endpoint: String },
    #[error("kv_offload.object_url {url}: {source}")]
    Client {
        url: String,
        source: object_store::Error,
    },
    #[error("kv_offload: cannot start the object tier's runtime: {0}")]
    Runtime(std::io::Error),
}

/// Sealed pages under a prefix of an object store.
pub struct S3PageStore {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    url: String,
    rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for S3PageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "S3PageStore({})", self.url)
    }
}

/// Bounded retries: a page is a cache entry — a slow store must not hold a restore (or the
/// write-back queue) for minutes. object_store's own timeouts stand (5 s to connect, 30 s a
/// request).
fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(500),
            base: 2.0,
        },
        max_retries: 2,
        retry_timeout: Duration::from_secs(5),
    }
}

fn parse(url: &str) -> Result<(String, String), S3TierError> {
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| S3TierError::Url(url.into()))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(S3TierError::Url(url.into()));
    }
    Ok((bucket.into(), prefix.trim_matches('/').into()))
}

impl S3PageStore {
    /// The store at `url` (`s3://bucket[/prefix]`), configured from the usual variables
    /// (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
    /// `AWS_ALLOW_HTTP=true` for an `http://` endpoint). Makes no connection.
    pub fn from_env(url: &str) -> Result<Self, S3TierError> {
        Self::with_builder(url, AmazonS3Builder::from_env())
    }

    /// [`S3PageStore::from_env`] from an explicit configuration.
    pub fn with_builder(url: &str, builder: AmazonS3Builder) -> Result<Self, S3TierError> {
        let (bucket, prefix) = parse(url)?;
        let endpoint = builder
            .get_config_value(&AmazonS3ConfigKey::Endpoint)
            .unwrap_or_default();
        let allow_http = builder
            .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
            .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes"));
        if endpoint.starts_with("http://") && !allow_http {
            return Err(S3TierError::PlainHttp {
                url: url.into(),
                endpoint,
            });
        }
        let store = builder
            .with_bucket_name(&bucket)
            .with_retry(retry_config())
            .build()
            .map_err(|source| S3TierError::Client {
                url: url.into(),
                source,
            })?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("custody-offload-s3")
            .enable_all()
            .build()
            .map_err(S3TierError::Runtime)?;
        Ok(Self {
            store: Arc::new(store),
            prefix: ObjectPath::from(prefix),
            url: url.into(),
            rt,
        })
    }

    fn path(&self, key: &BlockKey) -> ObjectPath {
        let name = format!("{}.kvpage", custody_engine::offload::seal::hex(key));
        self.prefix.clone().join(name)
    }

    fn err(&self, e: object_store::Error) -> StoreError {
        StoreError::Remote {
            tier: "object",
            reason: format!("{}: {e}", self.url),
        }
    }
}

fn key_of(path: &ObjectPath) -> Option<BlockKey> {
    custody_engine::offload::store::key_from_file_name(path.filename()?)
}

impl PageStore for S3PageStore {
    fn tier(&self) -> Tier {
        Tier::Object
    }
    fn shared(&self) -> bool {
        true
    }
    fn put(&self, key: &BlockKey, sealed: &[u8]) -> Result<(), StoreError> {
        let path = self.path(key);
        let payload = PutPayload::from(sealed.to_vec());
        self.rt
            .block_on(self.store.put(&path, payload))
            .map(|_| ())
            .map_err(|e| self.err(e))
    }
    fn get(&self, key: &BlockKey) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.path(key);
        self.rt
            .block_on(async {
                match self.store.get(&path).await {
                    Ok(r) => r.bytes().await.map(|b| Some(b.to_vec())),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .map_err(|e| self.err(e))
    }
    fn delete(&self, key: &BlockKey) -> Result<(), StoreError> {
        let path = self.path(key);
        match self.rt.block_on(self.store.delete(&path)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err(e)),
        }
    }
    fn list(&self) -> Result<Vec<Stored>, StoreError> {
        let metas: Vec<object_store::ObjectMeta> = self
            .rt
            .block_on(self.store.list(Some(&self.prefix)).try_collect())
            .map_err(|e| self.err(e))?;
        Ok(metas
            .iter()
            .filter_map(|m| {
                Some(Stored {
                    key: key_of(&m.location)?,
                    bytes: m.size,
                })
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_bucket_and_prefix() {
        assert_eq!(parse("s3://b/x/y/").unwrap(), ("b".into(), "x/y".into()));
        assert_eq!(parse("s3://b").unwrap(), ("b".into(), "".into()));
        assert!(parse("s3:///x").is_err());
        assert!(parse("gs://b").is_err());
        let k = [0xab; 32];
        let p = ObjectPath::from("fleet/kv")
            .join(format!("{}.kvpage", custody_engine::offload::seal::hex(&k)));
        assert_eq!(key_of(&p), Some(k));
        assert_eq!(key_of(&ObjectPath::from("fleet/kv/notes.txt")), None);
    }
}

//! Checkpoints in an object store: a place a node's own disk cannot rewrite (a separate bucket or
//! prefix, with its own credentials). The writer publishes into it through
//! [`ObjectCheckpointSink`]; `custody audit verify --expect-checkpoint s3://…` reads them back
//! with [`fetch_checkpoints`].

use std::sync::Arc;

use custody_audit::checkpoint::{Checkpoint, CheckpointSink, PublishError};
use custody_audit::digest::LogStore;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, path::Path as ObjectPath};

use crate::QueryError;
use crate::source::{AuditRoot, ObjectLogStore, s3_store};

/// Each node's newest checkpoint as `<prefix>/node=<n>.json` in an object store. Its calls block
/// on a runtime of its own (the writer's publisher thread is not async).
pub struct ObjectCheckpointSink {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
    rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for ObjectCheckpointSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectCheckpointSink")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

fn s3_parts(url: &str) -> Result<(String, String), QueryError> {
    match AuditRoot::parse(url)? {
        AuditRoot::S3 { bucket, prefix } => Ok((bucket, prefix)),
        AuditRoot::Local(_) => Err(QueryError::BadRoot(format!(
            "{url}: not an s3://bucket/prefix URL"
        ))),
    }
}

/// One worker: [`ObjectLogStore`] blocks through a runtime handle, which drives I/O only on a
/// multi-thread runtime.
fn runtime() -> Result<tokio::runtime::Runtime, QueryError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| QueryError::BadRoot(format!("cannot start an I/O runtime: {e}")))
}

impl ObjectCheckpointSink {
    /// A sink at `s3://bucket/prefix` (credentials and endpoint from the usual `AWS_*`
    /// variables, as for an audit root). Builds no connection.
    pub fn s3(url: &str) -> Result<Self, QueryError> {
        let (bucket, _) = s3_parts(url)?;
        Self::new(s3_store(&bucket)?, url)
    }

    /// A sink at `url` (`s3://bucket/prefix`) through an already configured client of its
    /// bucket.
    pub fn new(store: Arc<dyn ObjectStore>, url: &str) -> Result<Self, QueryError> {
        let (_, prefix) = s3_parts(url)?;
        Ok(Self {
            store,
            prefix,
            url: url.trim_end_matches('/').to_owned(),
            rt: runtime()?,
        })
    }
}

impl CheckpointSink for ObjectCheckpointSink {
    fn publish(&self, cp: &Checkpoint) -> Result<(), PublishError> {
        let name = format!("node={}.json", cp.body.node);
        let full = if self.prefix.is_empty() {
            name.clone()
        } else {
            format!("{}/{name}", self.prefix)
        };
        let fail = |why: String| PublishError {
            place: format!("{}/{name}", self.url),
            why,
        };
        let path = ObjectPath::parse(&full).map_err(|e| fail(e.to_string()))?;
        let body = PutPayload::from(cp.to_json().into_bytes());
        self.rt
            .block_on(self.store.put(&path, body))
            .map(|_| ())
            .map_err(|e| fail(e.to_string()))
    }
}

/// Every checkpoint under `s3://bucket/prefix` (each `.json` object, as an
/// [`ObjectCheckpointSink`] writes them), with the URL of the object it came from. Blocks: call
/// it outside async code.
pub fn fetch_checkpoints(url: &str) -> Result<Vec<(Checkpoint, String)>, QueryError> {
    let (bucket, _) = s3_parts(url)?;
    fetch_checkpoints_with(s3_store(&bucket)?, url)
}

/// [`fetch_checkpoints`] through an already configured client of the URL's bucket.
pub fn fetch_checkpoints_with(
    client: Arc<dyn ObjectStore>,
    url: &str,
) -> Result<Vec<(Checkpoint, String)>, QueryError> {
    let (_, prefix) = s3_parts(url)?;
    let rt = runtime()?;
    let store = ObjectLogStore::new(client, &prefix, url.to_owned(), rt.handle().clone());
    let mut out = Vec::new();
    for name in store.list("")?.into_iter().filter(|n| n.ends_with(".json")) {
        let text = String::from_utf8_lossy(&store.read(&name)?).into_owned();
        let place = store.locate(&name).display().to_string();
        for cp in Checkpoint::parse_all(&text) {
            match cp {
                Ok(cp) => out.push((cp, place.clone())),
                Err(e) => {
                    return Err(QueryError::BadRoot(format!("{place}: {e}")));
                }
            }
        }
    }
    Ok(out)
}

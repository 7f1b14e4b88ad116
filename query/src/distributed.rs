//! A session whose plans run somewhere else (a Ballista cluster, `custody-cluster`): what changes
//! when the tables cannot live in this process's memory.
//!
//! A distributed engine receives the *plan*, not the data: every table it reads must be named by
//! URLs that every worker can open. Two kinds of table live in this process's memory locally and
//! are written to a **scratch** location instead when [`Distributed`] is on the session:
//!
//! - the live (unsealed) segment's rows, `<table>_live` ([`crate::open_session_in`]): this
//!   process reads them (torn tails end a file, as locally) and writes one Parquet file per table;
//! - `CREATE TABLE … AS SELECT` ([`crate::run_script`]; the exposure question's intermediate
//!   tables): the SELECT runs on the cluster, which writes its result under the scratch location
//!   (the workers write it, nothing passes through this process), and the table is registered
//!   over exactly the files listed there afterwards.
//!
//! The audit root itself is only ever read, and only through the explicit list of verified files
//! (never a directory listing): the scratch location must be elsewhere (checked). This module
//! knows nothing of Ballista: it needs a session whose plans serialise (listing tables, views).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::TableProvider;
use datafusion::dataframe::DataFrameWriteOptions;
use datafusion::datasource::empty::EmptyTable;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::LogicalPlan;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::prelude::{DataFrame, SessionContext};
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::{AuditRoot, QueryError};

/// Most rows of live segments written to the scratch location per table: the live segment is
/// what a node wrote since its last seal (bounded by the writer's seal interval); more than this
/// is not a live segment but a log that was never sealed — seal it (or query it locally).
pub const LIVE_ROWS_MAX: usize = 10_000_000;

/// Marks a session as distributed (a [`datafusion::prelude::SessionConfig`] extension): its
/// in-memory tables go to this scratch location. One per session; [`Distributed::cleanup`]
/// removes what it wrote.
#[derive(Debug)]
pub struct Distributed {
    store: Arc<dyn ObjectStore>,
    /// Object path of this session's directory under the scratch location (unique per session).
    dir: ObjectPath,
    /// URL of the store's root: `file://` or `s3://bucket`.
    store_url: String,
    /// Numbers each materialised table's directory: a replaced table never shares files with
    /// its predecessor.
    next: AtomicU64,
}

impl Distributed {
    /// A session directory under `scratch` (a directory every worker can write and read, or
    /// `s3://bucket/prefix`), written through `store` (`None`: the local filesystem or an S3
    /// client from the environment). `scratch` must not be inside `root`: nothing is ever
    /// written into an audit root.
    pub fn new(
        scratch: &AuditRoot,
        root: &AuditRoot,
        store: Option<Arc<dyn ObjectStore>>,
    ) -> Result<Self, QueryError> {
        if inside(scratch, root) {
            return Err(QueryError::BadRoot(format!(
                "the scratch location {scratch} is inside the audit root {root}: nothing may be written into an audit root"
            )));
        }
        let session = format!(
            "custody-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        let (store, base, store_url): (Arc<dyn ObjectStore>, String, String) = match scratch {
            AuditRoot::Local(dir) => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| QueryError::BadRoot(format!("scratch {}: {e}", dir.display())))?;
                let abs = std::fs::canonicalize(dir)
                    .map_err(|e| QueryError::BadRoot(format!("scratch {}: {e}", dir.display())))?;
                let base = ObjectPath::from_absolute_path(&abs)
                    .map_err(|e| QueryError::BadRoot(format!("scratch {}: {e}", abs.display())))?;
                let store =
                    store.unwrap_or_else(|| Arc::new(object_store::local::LocalFileSystem::new()));
                (store, base.to_string(), "file://".to_owned())
            }
            AuditRoot::S3 { bucket, prefix } => {
                let store = match store {
                    Some(s) => s,
                    None => crate::source::s3_store(bucket)?,
                };
                (store, prefix.clone(), format!("s3://{bucket}"))
            }
        };
        let dir = if base.is_empty() {
            ObjectPath::from(session)
        } else {
            ObjectPath::from(format!("{base}/{session}"))
        };
        Ok(Self {
            store,
            dir,
            store_url,
            next: AtomicU64::new(0),
        })
    }

    /// The object store this session writes through, and the URL it is registered under
    /// (`file://`, `s3://bucket`).
    pub fn store(&self) -> (ObjectStoreUrl, Arc<dyn ObjectStore>) {
        let url = ObjectStoreUrl::parse(&self.store_url).expect("file:// or s3://bucket");
        (url, self.store.clone())
    }

    /// The URL of this session's directory (ends with `/`).
    pub fn url(&self) -> String {
        format!("{}/{}/", self.store_url, self.dir)
    }

    /// The session's distributed marker, if it has one.
    pub fn of(ctx: &SessionContext) -> Option<Arc<Self>> {
        ctx.state().config().get_extension::<Self>()
    }

    fn child(&self, name: &str) -> ObjectPath {
        ObjectPath::from(format!("{}/{name}", self.dir))
    }

    fn url_of(&self, p: &ObjectPath) -> String {
        format!("{}/{p}", self.store_url)
    }

    /// Write `batches` (rows this process holds) as one Parquet file and return a table over it.
    pub async fn write_table(
        &self,
        name: &str,
        schema: SchemaRef,
        batches: &[RecordBatch],
    ) -> Result<Arc<dyn TableProvider>, QueryError> {
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        if rows > LIVE_ROWS_MAX {
            return Err(QueryError::Verification(format!(
                "{name}: {rows} unsealed rows (more than {LIVE_ROWS_MAX}): seal the log before querying it on a cluster"
            )));
        }
        if rows == 0 {
            return Ok(Arc::new(EmptyTable::new(schema)));
        }
        let mut buf = Vec::new();
        let mut w = ArrowWriter::try_new(&mut buf, schema.clone(), None)
            .map_err(datafusion::error::DataFusionError::from)?;
        for b in batches {
            w.write(b)
                .map_err(datafusion::error::DataFusionError::from)?;
        }
        w.close()
            .map_err(datafusion::error::DataFusionError::from)?;
        let path = self.child(&format!("live/{name}.parquet"));
        self.store.put(&path, PutPayload::from(buf)).await?;
        table_over(&[self.url_of(&path)], schema)
    }

    /// `CREATE [OR REPLACE] TABLE name AS input`, distributed: the session's engine runs `input`
    /// and writes its result under this session's directory; `name` is then registered over
    /// exactly the files written there.
    pub async fn materialize(
        &self,
        ctx: &SessionContext,
        name: &str,
        input: &LogicalPlan,
    ) -> Result<(), QueryError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let dir = self.child(&format!("tables/{name}-{n}"));
        let url = format!("{}/", self.url_of(&dir));
        let schema: SchemaRef = Arc::new(input.schema().as_arrow().clone());
        DataFrame::new(ctx.state(), input.clone())
            .write_parquet(&url, DataFrameWriteOptions::new(), None)
            .await?;
        let listed: Vec<object_store::ObjectMeta> =
            self.store.list(Some(&dir)).try_collect().await?;
        let mut files: Vec<String> = listed
            .iter()
            .filter(|m| m.location.as_ref().ends_with(".parquet"))
            .map(|m| self.url_of(&m.location))
            .collect();
        files.sort();
        let table = table_over(&files, schema)?;
        // `OR REPLACE` and plain `CREATE` alike: the scripts this runs replace their own tables.
        ctx.deregister_table(name)?;
        ctx.register_table(name, table)?;
        Ok(())
    }
}

/// Delete every object under `dir`.
async fn remove_all(store: &dyn ObjectStore, dir: &ObjectPath) -> Result<(), object_store::Error> {
    let listed: Vec<object_store::ObjectMeta> = store.list(Some(dir)).try_collect().await?;
    for m in listed {
        store.delete(&m.location).await?;
    }
    Ok(())
}

/// The session's directory goes when the session does (its last context dropped), whether its
/// queries succeeded or not. A killed process leaves it behind (named `custody-<pid>-<time>`).
impl Drop for Distributed {
    fn drop(&mut self) {
        if self.store_url == "file://" {
            // The local store deletes files, not the directories it created for them.
            let _ = std::fs::remove_dir_all(format!("/{}", self.dir));
            return;
        }
        // Dropped on an async worker thread, most likely: delete from a thread of its own with
        // its own runtime (a runtime cannot block inside another).
        let store = self.store.clone();
        let dir = self.dir.clone();
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(remove_all(store.as_ref(), &dir))
                .map_err(std::io::Error::other)
        })
        .join();
        if !matches!(done, Ok(Ok(()))) {
            tracing::warn!(dir = %self.url(), "could not remove the cluster's scratch directory");
        }
    }
}

/// A table over exactly these Parquet files (URLs), or an empty one with `schema`.
pub fn table_over(
    files: &[String],
    schema: SchemaRef,
) -> Result<Arc<dyn TableProvider>, QueryError> {
    if files.is_empty() {
        return Ok(Arc::new(EmptyTable::new(schema)));
    }
    let urls = files
        .iter()
        .map(|f| ListingTableUrl::parse(f))
        .collect::<Result<Vec<_>, _>>()?;
    let opts =
        ListingOptions::new(Arc::new(ParquetFormat::default())).with_file_extension(".parquet");
    let cfg = ListingTableConfig::new_with_multi_paths(urls)
        .with_listing_options(opts)
        .with_schema(schema);
    Ok(Arc::new(ListingTable::try_new(cfg)?))
}

/// Whether `inner` is `outer` or under it (same kind of location only).
fn inside(inner: &AuditRoot, outer: &AuditRoot) -> bool {
    match (inner, outer) {
        (AuditRoot::Local(i), AuditRoot::Local(o)) => {
            let canon = |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or(p.to_path_buf());
            canon(i).starts_with(canon(o))
        }
        (
            AuditRoot::S3 {
                bucket: ib,
                prefix: ip,
            },
            AuditRoot::S3 {
                bucket: ob,
                prefix: op,
            },
        ) => ib == ob && (op.is_empty() || ip == op || ip.starts_with(&format!("{op}/"))),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scratch_location_is_never_inside_the_audit_root() {
        let p = |s: &str| AuditRoot::parse(s).expect("location");
        for (scratch, root) in [
            ("s3://audit/prod/tmp", "s3://audit/prod"),
            ("s3://audit/prod", "s3://audit/prod"),
            ("s3://audit/x", "s3://audit"),
            ("/var/audit/tmp", "/var/audit"),
        ] {
            assert!(inside(&p(scratch), &p(root)), "{scratch} in {root}");
        }
        for (scratch, root) in [
            ("s3://audit/production", "s3://audit/prod"),
            ("s3://scratch/prod", "s3://audit/prod"),
            ("/var/audit-tmp", "/var/audit"),
            ("/tmp/x", "s3://audit"),
        ] {
            assert!(!inside(&p(scratch), &p(root)), "{scratch} not in {root}");
        }
    }
}

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

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use datafusion::arrow::array::AsArray;
use datafusion::arrow::datatypes::{SchemaRef, UInt64Type};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::TableProvider;
use datafusion::dataframe::DataFrameWriteOptions;
use datafusion::datasource::empty::EmptyTable;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::{CreateMemoryTable, SetVariable};
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

/// How long dropping a session waits for its S3 scratch objects to be deleted.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Marks a session as distributed (a [`datafusion::prelude::SessionConfig`] extension): its
/// in-memory tables go to this scratch location. One per session; its directory is removed when
/// the session is dropped.
#[derive(Debug)]
pub struct Distributed {
    store: Arc<dyn ObjectStore>,
    /// Object path of this session's directory under the scratch location (unique per session).
    dir: ObjectPath,
    /// The same directory on this machine's filesystem, for a local scratch location.
    local_dir: Option<PathBuf>,
    /// URL of the store's root: `file://` or `s3://bucket`.
    store_url: String,
    /// Numbers each materialised table's directory: a replaced table never shares files with
    /// its predecessor.
    next: AtomicU64,
    /// Settings the engine needs to give the right answer (set by its crate on the session):
    /// a script's `SET` of one of them is refused.
    pinned: Vec<&'static str>,
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
        let bad = |why: String| QueryError::Scratch(format!("{scratch}: {why}"));
        let inside_root = || {
            bad(format!(
                "inside the audit root {root}: nothing may be written into an audit root"
            ))
        };
        let session = format!(
            "custody-{}-{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        match scratch {
            AuditRoot::Local(dir) => {
                let base = resolve(dir).map_err(bad)?;
                if let AuditRoot::Local(r) = root
                    && base.starts_with(resolve(r).map_err(bad)?)
                {
                    return Err(inside_root());
                }
                std::fs::create_dir_all(&base).map_err(|e| bad(e.to_string()))?;
                let local = base.join(&session);
                private_dir(&local).map_err(|e| bad(e.to_string()))?;
                let dir = ObjectPath::from_absolute_path(&local).map_err(|e| bad(e.to_string()))?;
                Ok(Self {
                    store: store
                        .unwrap_or_else(|| Arc::new(object_store::local::LocalFileSystem::new())),
                    dir,
                    local_dir: Some(local),
                    store_url: "file://".to_owned(),
                    next: AtomicU64::new(0),
                    pinned: Vec::new(),
                })
            }
            AuditRoot::S3 { bucket, prefix } => {
                if let AuditRoot::S3 {
                    bucket: rb,
                    prefix: rp,
                } = root
                    && rb == bucket
                    && (rp.is_empty() || prefix == rp || prefix.starts_with(&format!("{rp}/")))
                {
                    return Err(inside_root());
                }
                let store = match store {
                    Some(s) => s,
                    None => crate::source::s3_store(bucket)?,
                };
                let dir = if prefix.is_empty() {
                    ObjectPath::from(session)
                } else {
                    ObjectPath::from(format!("{prefix}/{session}"))
                };
                Ok(Self {
                    store,
                    dir,
                    local_dir: None,
                    store_url: format!("s3://{bucket}"),
                    next: AtomicU64::new(0),
                    pinned: Vec::new(),
                })
            }
        }
    }

    /// `key` is a setting the engine's answer depends on: a script may not change it.
    pub fn pin(mut self, key: &'static str) -> Self {
        self.pinned.push(key);
        self
    }

    /// Refuse a `SET` of a pinned setting.
    pub fn check_set(&self, set: &SetVariable) -> Result<(), QueryError> {
        if self
            .pinned
            .iter()
            .any(|k| k.eq_ignore_ascii_case(set.variable.trim()))
        {
            return Err(QueryError::Scratch(format!(
                "{} is fixed on a cluster session (the engine's answer depends on it)",
                set.variable
            )));
        }
        Ok(())
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
            return Err(QueryError::Scratch(format!(
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

    /// `CREATE [OR REPLACE] TABLE [IF NOT EXISTS] name AS input`, distributed, with the local
    /// semantics (an existing table: kept with `IF NOT EXISTS`, replaced with `OR REPLACE`, an
    /// error otherwise): the session's engine runs `input` and writes its result under this
    /// session's directory; `name` is then registered over exactly the files listed there —
    /// once their rows, counted from their footers, are exactly the rows the engine reports
    /// writing (a scratch location this process does not share with the executors, or a file
    /// written twice by a retried task, is an error, never a wrong table).
    pub async fn materialize(
        &self,
        ctx: &SessionContext,
        create: &CreateMemoryTable,
    ) -> Result<(), QueryError> {
        let name = create.name.clone();
        if ctx.table_exist(name.clone())? {
            if create.if_not_exists {
                return Ok(());
            }
            if !create.or_replace {
                return Err(datafusion::error::DataFusionError::Plan(format!(
                    "Table '{name}' already exists"
                ))
                .into());
            }
        }
        // Numbered, not named: a table name (quoted, any characters) never becomes a path.
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let dir = self.child(&format!("tables/{n}"));
        let url = format!("{}/", self.url_of(&dir));
        let schema: SchemaRef = Arc::new(create.input.schema().as_arrow().clone());
        let reported = DataFrame::new(ctx.state(), (*create.input).clone())
            .write_parquet(&url, DataFrameWriteOptions::new(), None)
            .await?;
        let written: u64 = reported
            .iter()
            .filter(|b| b.num_columns() > 0)
            .filter_map(|b| b.column(0).as_primitive_opt::<UInt64Type>())
            .flat_map(|c| c.iter().flatten())
            .sum();
        let mut listed: Vec<object_store::ObjectMeta> =
            self.store.list(Some(&dir)).try_collect().await?;
        listed.retain(|m| m.location.as_ref().ends_with(".parquet"));
        listed.sort_by(|a, b| a.location.cmp(&b.location));
        let mut readable = 0u64;
        for m in &listed {
            let meta = DFParquetMetadata::new(self.store.as_ref(), m)
                .fetch_metadata()
                .await?;
            readable += meta.file_metadata().num_rows().max(0) as u64;
        }
        if readable != written {
            return Err(QueryError::Scratch(format!(
                "{}: the cluster reports {written} rows written for table {name}, {readable} are readable here in {} files: the scratch location must be one that every executor and this process share, and that nothing else writes into",
                self.url(),
                listed.len()
            )));
        }
        let files: Vec<String> = listed.iter().map(|m| self.url_of(&m.location)).collect();
        let table = table_over(&files, schema)?;
        ctx.deregister_table(name.clone())?;
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
        let removed = match &self.local_dir {
            Some(local) => std::fs::remove_dir_all(local),
            None => {
                // Dropped on an async worker thread, most likely: delete from a thread of its
                // own with its own runtime (a runtime cannot block inside another), bounded.
                let store = self.store.clone();
                let dir = self.dir.clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    rt.block_on(async {
                        tokio::time::timeout(CLEANUP_TIMEOUT, remove_all(store.as_ref(), &dir))
                            .await
                            .map_err(std::io::Error::other)?
                            .map_err(std::io::Error::other)
                    })
                })
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the cleanup thread panicked")))
            }
        };
        if let Err(e) = removed {
            tracing::warn!(dir = %self.url(), error = %e, "could not remove the cluster's scratch directory");
        }
    }
}

/// A table over exactly these Parquet files (URLs), or an empty one with `schema`. Each URL is
/// one file: never read as a glob or a directory.
pub fn table_over(
    files: &[String],
    schema: SchemaRef,
) -> Result<Arc<dyn TableProvider>, QueryError> {
    if files.is_empty() {
        return Ok(Arc::new(EmptyTable::new(schema)));
    }
    let urls = files
        .iter()
        .map(|f| file_url(f))
        .collect::<Result<Vec<_>, _>>()?;
    let opts =
        ListingOptions::new(Arc::new(ParquetFormat::default())).with_file_extension(".parquet");
    let cfg = ListingTableConfig::new_with_multi_paths(urls)
        .with_listing_options(opts)
        .with_schema(schema);
    Ok(Arc::new(ListingTable::try_new(cfg)?))
}

/// One file's URL for a listing table: parsed as a URL, with no glob (`ListingTableUrl::parse`
/// would take `[`, `*`, `?` in a path for a pattern).
pub fn file_url(url: &str) -> Result<ListingTableUrl, QueryError> {
    let u = url::Url::parse(url).map_err(|e| QueryError::Path(format!("{url}: {e}")))?;
    Ok(ListingTableUrl::try_new(u, None)?)
}

/// `p` absolute, through every symbolic link of its longest existing ancestor (what the OS will
/// open); `..` is refused (it would be resolved differently before and after creation).
fn resolve(p: &Path) -> Result<PathBuf, String> {
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err("`..` is not allowed in a scratch path".to_owned());
    }
    let abs = std::path::absolute(p).map_err(|e| e.to_string())?;
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    while !existing.exists() {
        let (Some(name), Some(parent)) = (existing.file_name(), existing.parent()) else {
            return Err("no existing ancestor".to_owned());
        };
        rest.push(name.to_owned());
        existing = parent;
    }
    let mut out = std::fs::canonicalize(existing).map_err(|e| e.to_string())?;
    out.extend(rest.into_iter().rev());
    Ok(out)
}

/// Create `dir` (which must not exist) readable and writable by its owner only.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("custody-distributed-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("tmp");
        d
    }

    fn refused(scratch: &str, root: &str) -> String {
        let p = |s: &str| AuditRoot::parse(s).expect("location");
        Distributed::new(&p(scratch), &p(root), None)
            .expect_err(scratch)
            .to_string()
    }

    #[test]
    fn the_scratch_location_is_never_inside_the_audit_root() {
        let d = tmp("inside");
        let root = d.join("audit");
        std::fs::create_dir_all(&root).expect("root");
        std::os::unix::fs::symlink(&root, d.join("link")).expect("symlink");
        let r = root.to_str().expect("utf-8");
        for scratch in [
            format!("{r}/tmp"),
            r.to_owned(),
            format!("{}/link/tmp", d.display()),
            format!("{}/x/../audit/tmp", d.display()),
        ] {
            let e = refused(&scratch, r);
            assert!(
                e.contains("audit root") || e.contains(".."),
                "{scratch}: {e}"
            );
        }
        for (scratch, root) in [
            ("s3://audit/prod/tmp", "s3://audit/prod"),
            ("s3://audit/prod", "s3://audit/prod"),
            ("s3://audit/x", "s3://audit"),
        ] {
            assert!(refused(scratch, root).contains("audit root"), "{scratch}");
        }
        // Beside the root: allowed, and the session directory is private and removed on drop.
        let ok = Distributed::new(
            &AuditRoot::Local(d.join("audit-tmp")),
            &AuditRoot::Local(root.clone()),
            None,
        )
        .expect("beside the root");
        let local = ok.local_dir.clone().expect("local");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&local).expect("dir").permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        drop(ok);
        assert!(!local.exists());
        for (scratch, root) in [
            ("s3://audit/production", "s3://audit/prod"),
            ("s3://scratch/prod", "s3://audit/prod"),
        ] {
            let p = |s: &str| AuditRoot::parse(s).expect("location");
            let client: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
            assert!(
                Distributed::new(&p(scratch), &p(root), Some(client)).is_ok(),
                "{scratch}"
            );
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn file_urls_are_files_never_patterns() {
        let u = file_url("file:///var/audit%5B1%5D/page_reads/x%3F.parquet").expect("url");
        assert_eq!(
            u.as_str(),
            "file:///var/audit%5B1%5D/page_reads/x%3F.parquet"
        );
        assert!(!u.is_collection());
    }
}

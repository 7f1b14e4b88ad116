//! Custody's query side: a DataFusion session over an audit root.
//!
//! Architecture invariant: this crate reads only what `custody-audit` wrote, through the schema
//! `custody-audit` defines; it never links the runtime.
//!
//! - [`session_over`]: every table as a Hive-partitioned listing table (`node`, `date` partition
//!   columns) — everything on disk, for exploration.
//! - [`session_over_verified`]: what an incident responder should query — only the files that a
//!   verified digest names, plus the recoverable live segment as separate, clearly named
//!   `<table>_live` tables.
//! - [`open_session`]: the same over an [`AuditRoot`] — a directory or an object-store URL
//!   (`s3://bucket/prefix`, verified and read through the store: [`source`]) — optionally over
//!   every file, verified or not.
//!
//! - [`open_session_in`]: the same into a given context — a Ballista cluster's (`custody-cluster`),
//!   whose in-memory tables go to a scratch location instead ([`distributed`]).
//!
//! - [`forensics`]: the canned forensic questions as documented SQL; [`prepare_forensics`] adds
//!   the `all_<table>` views (sealed ∪ live) they run over.

pub mod checkpoints;
pub mod distributed;
pub mod forensics;
#[cfg(feature = "repl")]
pub mod repl;
pub mod report;
pub mod source;

pub use source::AuditRoot;

/// Re-exported so the binary uses the same DataFusion (and Arrow) as this crate.
pub use datafusion;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use custody_audit::digest::{self, LocalStore, LogStore, Report, StoreError};
use custody_audit::schema::Table;
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::ipc::reader::StreamReader;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::datasource::MemTable;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::prelude::SessionContext;

#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("audit root {0} is not a directory")]
    NoRoot(String),
    #[error(transparent)]
    DataFusion(#[from] datafusion::error::DataFusionError),
    #[error("path {0} is not valid UTF-8")]
    Path(String),
    #[error("audit root {0}")]
    BadRoot(String),
    #[error("audit root {0}: no objects under it")]
    EmptyRoot(String),
    // The next two hold their cause in the message, not as a `source` (which would print it
    // twice in an error chain).
    #[error("reading the audit root: {0}")]
    Store(StoreError),
    #[error("object store: {0}")]
    ObjectStore(datafusion::object_store::Error),
    #[error("verification did not finish: {0}")]
    Verification(String),
    #[error("no SQL statement given")]
    NoStatement,
    /// The cluster's scratch location (`--scratch`) or what the session put there.
    #[error("scratch location {0}")]
    Scratch(String),
}

impl From<StoreError> for QueryError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl From<datafusion::object_store::Error> for QueryError {
    fn from(e: datafusion::object_store::Error) -> Self {
        Self::ObjectStore(e)
    }
}

/// A DataFusion context with `information_schema` (for `SHOW TABLES`, `DESCRIBE`).
fn new_context() -> SessionContext {
    SessionContext::new_with_config(
        datafusion::prelude::SessionConfig::new().with_information_schema(true),
    )
}

/// A session with every audit table present under `root` registered by its name.
pub async fn session_over(root: &Path) -> Result<SessionContext, QueryError> {
    if !root.is_dir() {
        return Err(QueryError::NoRoot(root.display().to_string()));
    }
    let ctx = new_context();
    for table in Table::ALL {
        let dir = root.join(table.name());
        if !dir.is_dir() {
            continue;
        }
        let opts = ListingOptions::new(Arc::new(ParquetFormat::default()))
            .with_file_extension(".parquet")
            .with_table_partition_cols(vec![
                ("node".to_owned(), DataType::UInt32),
                ("date".to_owned(), DataType::Utf8),
            ]);
        let url = format!("{}/", dir.display());
        ctx.register_listing_table(table.name(), &url, opts, None, None)
            .await?;
    }
    Ok(ctx)
}

/// A session over the verified part of an audit root, and the verification report it rests on.
pub struct VerifiedSession {
    pub ctx: SessionContext,
    /// Problems found are *excluded* from the session (unless `unverified_included`); callers
    /// must surface them.
    pub report: Report,
    /// The caller asked for every file, verified or not ([`open_session`]): the problems are
    /// then *in* the session, and nothing read from it is evidence.
    pub unverified_included: bool,
}

impl std::fmt::Debug for VerifiedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifiedSession")
            .field("report", &self.report)
            .field("unverified_included", &self.unverified_included)
            .finish_non_exhaustive()
    }
}

/// A session over only the files a verified digest names (tables by their names; the table's
/// sealed files that failed verification are left out), plus every complete message of the
/// unsealed live segment as `<table>_live` (not covered by any digest: marked by its name).
pub async fn session_over_verified(
    root: &Path,
    key: Option<&ed25519_dalek::VerifyingKey>,
) -> Result<VerifiedSession, QueryError> {
    open_session(&AuditRoot::Local(root.to_path_buf()), key, false).await
}

/// [`session_over_verified`] over a directory or an object store. For `s3://…` the digests are
/// read and every sealed object is hashed through the store before it is registered, and the
/// tables read the same objects through the store registered on the context. With
/// `include_unverified`, the tables hold every Parquet file present, verified or not (the report
/// still lists every problem; callers must say so loudly). The S3 client is configured from the
/// environment ([`source::s3_store`]).
pub async fn open_session(
    root: &AuditRoot,
    key: Option<&ed25519_dalek::VerifyingKey>,
    include_unverified: bool,
) -> Result<VerifiedSession, QueryError> {
    open_session_with(root, None, key, include_unverified).await
}

/// [`open_session`] with the object-store client for an `s3://` root given (`None`: from the
/// environment); ignored for a directory.
pub async fn open_session_with(
    root: &AuditRoot,
    client: Option<Arc<dyn datafusion::object_store::ObjectStore>>,
    key: Option<&ed25519_dalek::VerifyingKey>,
    include_unverified: bool,
) -> Result<VerifiedSession, QueryError> {
    open_session_in(new_context(), root, client, key, include_unverified).await
}

/// [`open_session_with`] into `ctx` (which must have `information_schema` on). With a
/// [`distributed::Distributed`] marker on `ctx`, the live segments' rows are written to its
/// scratch location rather than held in memory: the cluster reads every table by URL.
pub async fn open_session_in(
    ctx: SessionContext,
    root: &AuditRoot,
    client: Option<Arc<dyn datafusion::object_store::ObjectStore>>,
    key: Option<&ed25519_dalek::VerifyingKey>,
    include_unverified: bool,
) -> Result<VerifiedSession, QueryError> {
    let distributed = distributed::Distributed::of(&ctx);
    if let Some(d) = &distributed {
        let (url, store) = d.store();
        ctx.register_object_store(url.as_ref(), store);
    }
    // `base`: what the report's paths start with (`LogStore::locate("")`).
    let (store, base): (Arc<dyn LogStore + Send + Sync>, PathBuf) = match root {
        AuditRoot::Local(dir) => {
            if !dir.is_dir() {
                return Err(QueryError::NoRoot(dir.display().to_string()));
            }
            (Arc::new(LocalStore::new(dir)), dir.clone())
        }
        AuditRoot::S3 { bucket, prefix } => {
            let s3 = match client {
                Some(c) => c,
                None => source::s3_store(bucket)?,
            };
            let bucket_url = ObjectStoreUrl::parse(format!("s3://{bucket}"))?;
            ctx.register_object_store(bucket_url.as_ref(), s3.clone());
            let url = root.to_string();
            let store = source::ObjectLogStore::new(
                s3,
                prefix,
                url.clone(),
                tokio::runtime::Handle::current(),
            );
            (Arc::new(store), PathBuf::from(url))
        }
    };
    let key = key.copied();
    let base_ = base.clone();
    // The audit crate's verification is synchronous (and the object store adapter blocks on the
    // runtime): run it, and read the live segment, off the async worker threads.
    let (report, live) = tokio::task::spawn_blocking(move || {
        let report = digest::verify_store(store.as_ref(), key.as_ref(), None, None)?;
        let live = read_live(store.as_ref(), &base_, &report);
        Ok::<_, StoreError>((report, live))
    })
    .await
    .map_err(|e| QueryError::Verification(e.to_string()))??;
    let nothing_there = report.valid_digests == 0
        && report.problems.is_empty()
        && report.parquet_files.is_empty()
        && report.live_segments.is_empty();
    if !root.is_local() && nothing_there {
        // An empty prefix is most likely a typo; a directory at least exists.
        return Err(QueryError::EmptyRoot(root.to_string()));
    }
    let files = if include_unverified {
        &report.parquet_files
    } else {
        &report.verified_files
    };
    for (table, live) in Table::ALL.into_iter().zip(live) {
        let mut urls = Vec::new();
        for f in files {
            if table_of(&base, f) == Some(table.name()) {
                urls.push(verified_file_url(root, f)?);
            }
        }
        if !urls.is_empty() {
            let opts = ListingOptions::new(Arc::new(ParquetFormat::default()))
                .with_file_extension(".parquet");
            let cfg = ListingTableConfig::new_with_multi_paths(urls)
                .with_listing_options(opts)
                .with_schema(table.schema());
            ctx.register_table(table.name(), Arc::new(ListingTable::try_new(cfg)?))?;
        }
        if !live.is_empty() {
            let name = format!("{}_live", table.name());
            match &distributed {
                Some(d) => {
                    let t = d.write_table(&name, table.schema(), &live).await?;
                    ctx.register_table(name, t)?;
                }
                None => {
                    let mem = MemTable::try_new(table.schema(), vec![live])?;
                    ctx.register_table(name, Arc::new(mem))?;
                }
            }
        }
    }
    Ok(VerifiedSession {
        ctx,
        report,
        unverified_included: include_unverified,
    })
}

/// The URL of one verified file: a local path as the OS resolves it (symbolic links, `..`),
/// percent-encoded; an object's URL as the store names it. Never a pattern or a directory.
fn verified_file_url(root: &AuditRoot, f: &Path) -> Result<ListingTableUrl, QueryError> {
    let bad = || QueryError::Path(f.display().to_string());
    if root.is_local() {
        let abs = std::fs::canonicalize(f).map_err(|_| bad())?;
        let url = url::Url::from_file_path(&abs).map_err(|()| bad())?;
        return Ok(ListingTableUrl::try_new(url, None)?);
    }
    distributed::file_url(f.to_str().ok_or_else(bad)?)
}

/// The first path component below `base` (the table directory), if `f` is under `base`.
fn table_of<'a>(base: &Path, f: &'a Path) -> Option<&'a str> {
    f.strip_prefix(base)
        .ok()?
        .components()
        .next()?
        .as_os_str()
        .to_str()
}

/// Every complete message of each table's live segment files, in [`Table::ALL`] order. A file
/// that cannot be read is skipped, and a torn tail (crash) ends a file: the live segment is
/// covered by no digest, and is read for what it holds.
fn read_live(store: &dyn LogStore, base: &Path, report: &Report) -> Vec<Vec<RecordBatch>> {
    Table::ALL
        .into_iter()
        .map(|table| {
            let suffix = format!("-{}.arrows", table.name());
            let mut live = Vec::new();
            for f in report
                .live_segments
                .iter()
                .filter(|p| p.to_string_lossy().ends_with(&suffix))
            {
                let Some(rel) = f.strip_prefix(base).ok().and_then(Path::to_str) else {
                    continue;
                };
                let Ok(bytes) = store.read(rel) else {
                    continue;
                };
                let Ok(reader) = StreamReader::try_new(std::io::Cursor::new(bytes), None) else {
                    continue;
                };
                live.extend(reader.map_while(Result::ok));
            }
            live
        })
        .collect()
}

/// Run every statement of `sql` in order — `;`-separated, `--` comments allowed, `SET`
/// statements applied to `ctx` — and return the result of each statement that yields rows
/// (`SET` and other statements without rows yield none). What `--show-sql` prints runs here as
/// printed. On a distributed session, `CREATE TABLE … AS SELECT` is materialised on the cluster
/// ([`distributed::Distributed::materialize`]).
pub async fn run_script(
    ctx: &SessionContext,
    sql: &str,
) -> Result<Vec<Vec<RecordBatch>>, QueryError> {
    use datafusion::logical_expr::{DdlStatement, LogicalPlan, Statement};
    let statements = datafusion::sql::parser::DFParser::parse_sql(sql)?;
    if statements.is_empty() {
        return Err(QueryError::NoStatement);
    }
    let mut results = Vec::new();
    let distributed = distributed::Distributed::of(ctx);
    for statement in statements {
        let plan = ctx.state().statement_to_plan(statement).await?;
        if let Some(d) = &distributed {
            match &plan {
                LogicalPlan::Ddl(DdlStatement::CreateMemoryTable(create)) => {
                    d.materialize(ctx, create).await?;
                    continue;
                }
                LogicalPlan::Statement(Statement::SetVariable(set)) => d.check_set(set)?,
                _ => {}
            }
        }
        let rows = !matches!(plan, LogicalPlan::Statement(_) | LogicalPlan::Ddl(_));
        let batches = ctx.execute_logical_plan(plan).await?.collect().await?;
        if rows {
            results.push(batches);
        }
    }
    Ok(results)
}

/// Make every table queryable for the forensic SQL, even when a node never wrote it: register an
/// empty table for each missing one, and a view `all_<table>` = sealed rows ∪ live rows (the live
/// segment is not covered by any digest yet; callers say so when it is non-empty).
pub async fn prepare_forensics(ctx: &SessionContext) -> Result<(), QueryError> {
    for table in Table::ALL {
        for name in [table.name().to_owned(), format!("{}_live", table.name())] {
            if !ctx.table_exist(name.as_str())? {
                // An `EmptyTable`, not an empty `MemTable`: a distributed session's plans
                // serialise it.
                let empty = datafusion::datasource::empty::EmptyTable::new(table.schema());
                ctx.register_table(name.as_str(), Arc::new(empty))?;
            }
        }
        let t = table.name();
        ctx.sql(&format!(
            "CREATE VIEW all_{t} AS SELECT * FROM {t} UNION ALL SELECT * FROM {t}_live"
        ))
        .await?;
    }
    Ok(())
}

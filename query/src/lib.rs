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
//!
//! - [`forensics`]: the canned forensic questions as documented SQL; [`prepare_forensics`] adds
//!   the `all_<table>` views (sealed ∪ live) they run over.

pub mod forensics;
pub mod report;

/// Re-exported so the binary uses the same DataFusion (and Arrow) as this crate.
pub use datafusion;

use std::path::Path;
use std::sync::Arc;

use custody_audit::digest::{self, Report};
use custody_audit::schema::Table;
use datafusion::arrow::datatypes::DataType;
use datafusion::arrow::ipc::reader::StreamReader;
use datafusion::datasource::MemTable;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::prelude::SessionContext;

#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("audit root {0} is not a directory")]
    NoRoot(String),
    #[error(transparent)]
    DataFusion(#[from] datafusion::error::DataFusionError),
    #[error("path {0} is not valid UTF-8")]
    Path(String),
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
    /// Problems found are *excluded* from the session; callers must surface them.
    pub report: Report,
}

impl std::fmt::Debug for VerifiedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifiedSession")
            .field("report", &self.report)
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
    if !root.is_dir() {
        return Err(QueryError::NoRoot(root.display().to_string()));
    }
    let report = digest::verify(root, key, None, None);
    let ctx = new_context();
    for table in Table::ALL {
        let mut urls = Vec::new();
        for f in &report.verified_files {
            let in_table = f
                .strip_prefix(root)
                .ok()
                .and_then(|r| r.components().next())
                .is_some_and(|c| c.as_os_str() == table.name());
            if in_table {
                let s = f
                    .to_str()
                    .ok_or_else(|| QueryError::Path(f.display().to_string()))?;
                urls.push(ListingTableUrl::parse(s)?);
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
        let suffix = format!("-{}.arrows", table.name());
        let mut live = Vec::new();
        for f in report
            .live_segments
            .iter()
            .filter(|p| p.to_string_lossy().ends_with(&suffix))
        {
            let Ok(file) = std::fs::File::open(f) else {
                continue;
            };
            let Ok(reader) = StreamReader::try_new(file, None) else {
                continue;
            };
            // Every complete message; a torn tail (crash) ends the file.
            live.extend(reader.map_while(Result::ok));
        }
        if !live.is_empty() {
            let mem = MemTable::try_new(table.schema(), vec![live])?;
            ctx.register_table(format!("{}_live", table.name()), Arc::new(mem))?;
        }
    }
    Ok(VerifiedSession { ctx, report })
}

/// Make every table queryable for the forensic SQL, even when a node never wrote it: register an
/// empty table for each missing one, and a view `all_<table>` = sealed rows ∪ live rows (the live
/// segment is not covered by any digest yet; callers say so when it is non-empty).
pub async fn prepare_forensics(ctx: &SessionContext) -> Result<(), QueryError> {
    for table in Table::ALL {
        for name in [table.name().to_owned(), format!("{}_live", table.name())] {
            if !ctx.table_exist(name.as_str())? {
                let empty = MemTable::try_new(table.schema(), vec![vec![]])?;
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

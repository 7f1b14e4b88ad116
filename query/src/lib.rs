//! Custody's query side: a DataFusion session over an audit root.
//!
//! Architecture invariant: this crate reads only what `custody-audit` wrote, through the schema
//! `custody-audit` defines; it never links the runtime.
//!
//! Today: every audit table registered as a Hive-partitioned listing table (`node`, `date`
//! partition columns). The forensic questions and the verified-files-only session arrive with the
//! forensics issue.

use std::path::Path;
use std::sync::Arc;

use custody_audit::schema::Table;
use datafusion::arrow::datatypes::DataType;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::ListingOptions;
use datafusion::prelude::SessionContext;

#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    #[error("audit root {0} is not a directory")]
    NoRoot(String),
    #[error(transparent)]
    DataFusion(#[from] datafusion::error::DataFusionError),
}

/// A session with every audit table present under `root` registered by its name.
pub async fn session_over(root: &Path) -> Result<SessionContext, QueryError> {
    if !root.is_dir() {
        return Err(QueryError::NoRoot(root.display().to_string()));
    }
    let ctx = SessionContext::new();
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

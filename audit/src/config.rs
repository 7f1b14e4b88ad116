//! `[audit]`: where and how a node records its audit log (plain data; the binary deserialises it
//! from the node's TOML file and owns the writer it configures).

use std::path::PathBuf;

use serde::Deserialize;

/// Where and how the node records its audit log (read by the binary, which owns the writer: the
/// runtime itself only sees the sink trait).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuditSection {
    /// Audit root; unset = audit off.
    pub dir: Option<PathBuf>,
    /// Ed25519 signing key (`custody audit keygen`). Keep it outside the audit root.
    pub key: Option<PathBuf>,
    /// Node id recorded with every event.
    pub node: u32,
    /// fsync the live segment at most this often; 0 = after every batch.
    pub fsync_interval_ms: u64,
    /// Drop (and count) events instead of pausing admission when the queue is full.
    pub allow_drop: bool,
}

//! `[audit]`: where and how a node records its audit log (plain data; the binary deserialises it
//! from the node's TOML file and owns the writer it configures).

use std::path::PathBuf;

use serde::Deserialize;

/// Where and how the node records its audit log (read by the binary, which owns the writer: the
/// runtime itself only sees the sink trait).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuditSection {
    /// Audit root; unset = the default root (`defaults::default_root`: `$XDG_STATE_HOME/custody/audit`,
    /// else `~/.local/state/custody/audit`). Audit is off only with the command line's `--no-audit`.
    pub dir: Option<PathBuf>,
    /// Ed25519 signing key (`custody audit keygen`). Keep it outside the audit root. Unset with
    /// the default root: the default key (`defaults::default_key_path`), made on first use.
    pub key: Option<PathBuf>,
    /// A pair's or a fleet's node (`custody prefill|decode`, `custody serve` in front of a pair
    /// or as a fleet's router) refuses `--no-audit` unless its config says this too: turning
    /// audit off there takes both the command line and the configuration.
    pub allow_no_audit: bool,
    /// Node id recorded with every event.
    pub node: u32,
    /// fsync the live segment at most this often; 0 = after every batch.
    pub fsync_interval_ms: u64,
    /// Drop (and count) events instead of pausing admission when the queue is full.
    pub allow_drop: bool,
    /// Signed checkpoints of the chain (`checkpoint`), published at least this often, idle or
    /// not, besides after every seal; 0 = the writer's default (60 s).
    pub checkpoint_interval_s: u64,
    /// Seal the live segment (Parquet, digest, Merkle tree, checkpoint note) at least this
    /// often; 0 = the writer's default (300 s). Sooner means proofs and cosignatures sooner,
    /// and more, smaller files.
    pub seal_interval_s: u64,
    /// Directories on other disks or mounts (a peer's volume) that receive this node's newest
    /// checkpoint — places this node's own storage cannot rewrite.
    pub checkpoint_dirs: Vec<PathBuf>,
    /// Also print every checkpoint on stdout (`custody-checkpoint {json}`) for a log collector.
    pub checkpoint_stdout: bool,
    /// An object-store prefix (`s3://bucket/prefix`) that receives this node's newest
    /// checkpoint (a build with the `forensics` feature; `AWS_*` variables as for a root).
    pub checkpoint_url: Option<String>,
    /// Directories where other nodes (peers) publish their checkpoints: each new one is kept
    /// in this node's log (`node_events` `checkpoint`), where a cut of their tails shows.
    pub checkpoints_from: Vec<PathBuf>,
    /// The Merkle tree's origin: the first line of its signed checkpoints and the name of the
    /// node's note key (a schema-less URL, no spaces or `+`). Unset:
    /// `custody.invalid/audit/node-<n>/<key prefix>` (`tree_store::default_origin`).
    pub origin: Option<String>,
    /// Also write the tree's full level-0 tiles at every seal (32 bytes per record; see
    /// `WriterConfig::level0_tiles`), so the root can be published as static tiles as it is.
    pub level0_tiles: bool,
    /// tlog witnesses (`custody witness serve`) that cosign this node's tree checkpoints:
    /// `[[audit.witnesses]]` with `url` (`http://host:port`) and `vkey` (`custody witness
    /// vkey`). After every checkpoint the node sends them its newest; one that is down or
    /// refuses is logged, counted and recorded (`node_events` `tlog_uncosigned`), never fatal.
    pub witnesses: Vec<crate::tree_store::WitnessTarget>,
    /// Fail closed on missing cosignatures: while the newest cosigning round got fewer than
    /// this many of `witnesses`' cosignatures, the node takes no new work (503
    /// `audit_uncosigned`, `/health/ready` 503). 0 (the default): serve on, and say so.
    pub require_cosignatures: usize,
}

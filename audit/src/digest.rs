//! Tamper evidence, after AWS CloudTrail's log-file validation.
//!
//! Every seal writes `_digests/node=<id>/<digest_seq>.json`: the SHA-256, size and row count of
//! each sealed Parquet file, the node sequence range it covers, the SHA-256 of the previous digest
//! file and the previous digest's signature, all signed with the node's Ed25519 key (the signature
//! covers the canonical JSON of every other field). [`verify`] walks the chain and reports every
//! modified, truncated, missing, extra or reordered file, every broken or reordered digest link,
//! every bad signature and every sequence gap.
//!
//! [`verify_store`] does the same over any [`LogStore`] (a flat namespace of objects named by
//! `/`-separated paths relative to the audit root): [`LocalStore`] is a directory, and the query
//! crate implements it over an object store. This crate knows nothing of object stores.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Signer, Verifier};
/// The key types of the digest chain (re-exported: callers name them without the crate).
pub use ed25519_dalek::{SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::checkpoint::{Checkpoint, CheckpointError};

pub const DIGEST_FORMAT: &str = "custody-audit-digest-1";

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// SHA-256 (hex) and size of a file.
pub fn sha256_file(path: &Path) -> std::io::Result<(String, u64)> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex(&h.finalize()), n))
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SealedFile {
    /// Relative to the audit root.
    pub path: String,
    pub table: String,
    pub sha256: String,
    pub bytes: u64,
    pub rows: u64,
}

/// The signed part of a digest (field order is the canonical order).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DigestBody {
    pub format: String,
    pub node: u32,
    pub digest_seq: u64,
    pub segment: u64,
    /// Node sequence numbers `seq_start..seq_end` (end exclusive) are accounted for here:
    /// the sum of `files[].rows` plus `lost_unacknowledged`.
    pub seq_start: u64,
    pub seq_end: u64,
    /// Events that had been assigned a sequence number but never reached disk before a crash
    /// (never acknowledged as durable). Declared, not hidden.
    pub lost_unacknowledged: u64,
    pub sealed_wall_ns: i64,
    pub files: Vec<SealedFile>,
    pub previous_digest_sha256: Option<String>,
    pub previous_signature: Option<String>,
    pub public_key: String,
    /// The Merkle tree over the node's records after this seal (`crate::leaf`: leaf index =
    /// `seq`, so its size is `seq_end`) and its root (hex). Absent in digests written before
    /// the tree existed: they serialise, and so verify, byte for byte as they were signed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree_root: Option<String>,
}

/// The Merkle tree of a node's records as a digest commits to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeHead {
    pub size: u64,
    pub root: [u8; 32],
}

impl DigestBody {
    /// The tree this digest commits to (`None`: written before the tree, or its fields are
    /// malformed — `verify` tells the two apart).
    pub fn tree(&self) -> Option<TreeHead> {
        let size = self.tree_size?;
        let root = unhex(self.tree_root.as_deref()?)?.try_into().ok()?;
        Some(TreeHead { size, root })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DigestFile {
    #[serde(flatten)]
    pub body: DigestBody,
    pub signature: String,
}

/// Where the chain of one node stands (loaded from its last digest).
#[derive(Clone, Debug, Default)]
pub struct ChainHead {
    pub next_seq: u64,
    pub next_segment: u64,
    pub next_digest: u64,
    pub prev_sha256: Option<String>,
    pub prev_signature: Option<String>,
    /// The tree the newest digest commits to (`None`: no digest, or one from before the tree).
    pub tree: Option<TreeHead>,
}

/// Why a digest or a key could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", .path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: not a hex Ed25519 {what}", .path.display())]
    NotAKey { path: PathBuf, what: &'static str },
    #[error("{}: {source}", .path.display())]
    BadKey {
        path: PathBuf,
        source: ed25519_dalek::SignatureError,
    },
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> DigestError + '_ {
    move |source| DigestError::Io {
        path: path.to_owned(),
        source,
    }
}

fn json_at(path: &Path) -> impl FnOnce(serde_json::Error) -> DigestError + '_ {
    move |source| DigestError::Json {
        path: path.to_owned(),
        source,
    }
}

fn digest_dir(root: &Path, node: u32) -> PathBuf {
    root.join("_digests").join(format!("node={node}"))
}

fn canonical(body: &DigestBody) -> Vec<u8> {
    // serde_json writes struct fields in declaration order: deterministic bytes.
    serde_json::to_vec(body).unwrap_or_default()
}

impl ChainHead {
    pub fn load(root: &Path, node: u32) -> Result<Self, DigestError> {
        let dir = digest_dir(root, node);
        let Ok(rd) = fs::read_dir(&dir) else {
            return Ok(Self::default());
        };
        let mut names: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        names.sort();
        let Some(last) = names.last() else {
            return Ok(Self::default());
        };
        let bytes = fs::read(last).map_err(io_at(last))?;
        let d: DigestFile = serde_json::from_slice(&bytes).map_err(json_at(last))?;
        Ok(Self {
            next_seq: d.body.seq_end,
            next_segment: d.body.segment + 1,
            next_digest: d.body.digest_seq + 1,
            prev_sha256: Some(hex(&Sha256::digest(&bytes))),
            tree: d.body.tree(),
            prev_signature: Some(d.signature),
        })
    }
}

impl DigestFile {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        head: &ChainHead,
        node: u32,
        segment: u64,
        seq_start: u64,
        seq_end: u64,
        sealed_wall_ns: i64,
        files: Vec<SealedFile>,
        tree: TreeHead,
        key: &SigningKey,
    ) -> Self {
        debug_assert_eq!(tree.size, seq_end, "leaf index = seq");
        let rows: u64 = files.iter().map(|f| f.rows).sum();
        let body = DigestBody {
            format: DIGEST_FORMAT.to_owned(),
            node,
            digest_seq: head.next_digest,
            segment,
            seq_start,
            seq_end,
            lost_unacknowledged: (seq_end - seq_start).saturating_sub(rows),
            sealed_wall_ns,
            files,
            previous_digest_sha256: head.prev_sha256.clone(),
            previous_signature: head.prev_signature.clone(),
            public_key: hex(key.verifying_key().as_bytes()),
            tree_size: Some(tree.size),
            tree_root: Some(hex(&tree.root)),
        };
        let signature = hex(&key.sign(&canonical(&body)).to_bytes());
        Self { body, signature }
    }

    /// Write durably (temp, fsync, rename, fsync dir) and return the new chain head.
    pub fn write(&self, root: &Path) -> Result<ChainHead, DigestError> {
        let dir = digest_dir(root, self.body.node);
        fs::create_dir_all(&dir).map_err(io_at(&dir))?;
        let bytes = serde_json::to_vec_pretty(self).map_err(json_at(&dir))?;
        let name = format!("{:016}.json", self.body.digest_seq);
        let tmp = dir.join(format!(".{name}.tmp"));
        let path = dir.join(name);
        let res: std::io::Result<()> = (|| {
            let mut f = fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut f, &bytes)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)?;
            fs::File::open(&dir)?.sync_all()
        })();
        res.map_err(io_at(&path))?;
        Ok(ChainHead {
            next_seq: self.body.seq_end,
            next_segment: self.body.segment + 1,
            next_digest: self.body.digest_seq + 1,
            prev_sha256: Some(hex(&Sha256::digest(&bytes))),
            prev_signature: Some(self.signature.clone()),
            tree: self.body.tree(),
        })
    }
}

/// A new random signing key (from the OS).
pub fn generate_key() -> std::io::Result<SigningKey> {
    let mut seed = [0u8; 32];
    fs::File::open("/dev/urandom")?.read_exact(&mut seed)?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Write `key` (hex seed, mode 0600) to `path` and its public key to `<path>.pub` (the whole
/// name with `.pub` appended: `k.key` → `k.key.pub`). Returns the public key's path.
pub fn write_key(key: &SigningKey, path: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    std::io::Write::write_all(&mut f, hex(&key.to_bytes()).as_bytes())?;
    f.sync_all()?;
    write_public_key(key, path)
}

/// `key`'s public half in `<path>.pub`; returns that path.
pub fn write_public_key(key: &SigningKey, path: &Path) -> std::io::Result<PathBuf> {
    let mut pub_name = path.as_os_str().to_owned();
    pub_name.push(".pub");
    let pub_path = PathBuf::from(pub_name);
    fs::write(&pub_path, hex(key.verifying_key().as_bytes()))?;
    Ok(pub_path)
}

/// The 32 bytes of a hex key file.
fn read_key_bytes(path: &Path, what: &'static str) -> Result<[u8; 32], DigestError> {
    let s = fs::read_to_string(path).map_err(io_at(path))?;
    unhex(s.trim())
        .and_then(|v| v.try_into().ok())
        .ok_or_else(|| DigestError::NotAKey {
            path: path.to_owned(),
            what,
        })
}

pub fn read_signing_key(path: &Path) -> Result<SigningKey, DigestError> {
    Ok(SigningKey::from_bytes(&read_key_bytes(path, "seed")?))
}

pub fn read_verifying_key(path: &Path) -> Result<VerifyingKey, DigestError> {
    VerifyingKey::from_bytes(&read_key_bytes(path, "public key")?).map_err(|source| {
        DigestError::BadKey {
            path: path.to_owned(),
            source,
        }
    })
}

/// One finding of [`verify`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Problem {
    DigestUnreadable {
        digest: PathBuf,
        why: String,
    },
    BadSignature {
        digest: PathBuf,
    },
    WrongKey {
        digest: PathBuf,
        key: String,
    },
    DigestMissing {
        node: u32,
        digest_seq: u64,
    },
    DigestOutOfOrder {
        digest: PathBuf,
        expected_seq: u64,
        found_seq: u64,
    },
    ChainBroken {
        digest: PathBuf,
        why: String,
    },
    SequenceGap {
        node: u32,
        expected: u64,
        found: u64,
    },
    RowsMismatch {
        digest: PathBuf,
        accounted: u64,
        range: u64,
    },
    FileMissing {
        path: PathBuf,
    },
    FileModified {
        path: PathBuf,
    },
    FileTruncated {
        path: PathBuf,
        sealed_bytes: u64,
        found_bytes: u64,
    },
    FileReordered {
        path: PathBuf,
        holds_content_of: PathBuf,
    },
    FileExtra {
        path: PathBuf,
    },
    /// A sealed file, or the root itself, could not be read (permissions, an object store's error).
    Unreadable {
        path: PathBuf,
        why: String,
    },
    /// No digest at all under the root: nothing is sealed, so nothing is verified.
    EmptyRoot,
    /// A checkpoint (kept outside the chain) names digest `checkpoint_digest_seq` of `node`, but
    /// the chain ends before it: the newest sealings were deleted (`last_present`: the newest
    /// digest still there).
    TailCut {
        node: u32,
        checkpoint_digest_seq: u64,
        last_present: Option<u64>,
        place: String,
    },
    /// The node's digest `digest_seq` is not the file its checkpoint hashed: the chain was
    /// rewritten after the checkpoint (a fork).
    CheckpointMismatch {
        node: u32,
        digest_seq: u64,
        place: String,
    },
    /// A checkpoint that claims to be signed by the node's key, but is not (altered).
    CheckpointInvalid {
        place: String,
        why: String,
    },
    /// A node that should be in the root (`--expect-node`) has no chain of its own and no
    /// checkpoint that vouches for sealed data of it.
    NodeMissing {
        node: u32,
    },
    /// The node's newest evidence (a sealing or a checkpoint) is older than allowed before
    /// `now`: its log stopped, or its recent part was removed.
    Stale {
        node: u32,
        last_evidence_wall_ns: Option<i64>,
        max_age_s: u64,
    },
    /// The Merkle tree rebuilt from the sealed records is not the one digest `digest_seq`
    /// signs (or the records do not make one leaf per sequence number).
    TreeMismatch {
        node: u32,
        digest_seq: u64,
        why: String,
    },
    /// A tile (or the checkpoint note) the tree needs is not under `_tlog/`.
    TileMissing {
        path: PathBuf,
    },
    /// A tile's hashes are not the ones the sealed records make.
    TileModified {
        path: PathBuf,
    },
    /// The node's signed checkpoint note is not signed by its key, or names a tree the sealed
    /// records do not make.
    TreeCheckpointInvalid {
        node: u32,
        why: String,
    },
    /// `--witness`: the node's tree has no checkpoint cosigned by enough of the given witnesses.
    NotWitnessed {
        node: u32,
        why: String,
    },
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::DigestUnreadable { digest, why } => {
                write!(f, "digest {} unreadable: {why}", digest.display())
            }
            Problem::BadSignature { digest } => write!(
                f,
                "digest {} has an INVALID signature (altered)",
                digest.display()
            ),
            Problem::WrongKey { digest, key } => write!(
                f,
                "digest {} is signed by an unexpected key {key}",
                digest.display()
            ),
            Problem::DigestMissing { node, digest_seq } => {
                write!(f, "digest {digest_seq} of node {node} is MISSING")
            }
            Problem::DigestOutOfOrder {
                digest,
                expected_seq,
                found_seq,
            } => {
                write!(
                    f,
                    "digest {} is out of order: expected digest_seq {expected_seq}, found {found_seq}",
                    digest.display()
                )
            }
            Problem::ChainBroken { digest, why } => {
                write!(f, "digest chain broken at {}: {why}", digest.display())
            }
            Problem::SequenceGap {
                node,
                expected,
                found,
            } => {
                write!(
                    f,
                    "sequence gap on node {node}: expected seq {expected}, next digest starts at {found}"
                )
            }
            Problem::RowsMismatch {
                digest,
                accounted,
                range,
            } => {
                write!(
                    f,
                    "digest {} accounts for {accounted} events but covers {range} sequence numbers",
                    digest.display()
                )
            }
            Problem::FileMissing { path } => write!(f, "file {} is MISSING", path.display()),
            Problem::FileModified { path } => {
                write!(f, "file {} was MODIFIED (SHA-256 mismatch)", path.display())
            }
            Problem::FileTruncated {
                path,
                sealed_bytes,
                found_bytes,
            } => {
                write!(
                    f,
                    "file {} is TRUNCATED: sealed with {sealed_bytes} bytes, now {found_bytes}",
                    path.display()
                )
            }
            Problem::FileReordered {
                path,
                holds_content_of,
            } => {
                write!(
                    f,
                    "file {} holds the content sealed as {} (files swapped or reordered)",
                    path.display(),
                    holds_content_of.display()
                )
            }
            Problem::FileExtra { path } => {
                write!(f, "file {} is EXTRA: no digest names it", path.display())
            }
            Problem::Unreadable { path, why } => {
                write!(f, "{} could NOT BE READ: {why}", path.display())
            }
            Problem::EmptyRoot => {
                write!(f, "NO DIGEST under the root: nothing is sealed or verified")
            }
            Problem::TailCut {
                node,
                checkpoint_digest_seq,
                last_present,
                place,
            } => {
                let last = last_present.map_or("none".to_owned(), |s| s.to_string());
                write!(
                    f,
                    "TAIL CUT on node {node}: the checkpoint in {place} names digest {checkpoint_digest_seq}, but the chain ends at digest {last} (sealed data deleted)"
                )
            }
            Problem::CheckpointMismatch {
                node,
                digest_seq,
                place,
            } => write!(
                f,
                "digest {digest_seq} of node {node} is NOT the one the checkpoint in {place} hashed (chain rewritten)"
            ),
            Problem::CheckpointInvalid { place, why } => {
                write!(f, "checkpoint in {place} is INVALID: {why}")
            }
            Problem::NodeMissing { node } => {
                write!(
                    f,
                    "node {node} is MISSING: no digest of its own and no checkpoint of sealed data of it"
                )
            }
            Problem::Stale {
                node,
                last_evidence_wall_ns,
                max_age_s,
            } => match last_evidence_wall_ns {
                Some(ns) => write!(
                    f,
                    "node {node} is STALE: its newest sealing or checkpoint (wall ns {ns}) is more than {max_age_s} s old"
                ),
                None => write!(f, "node {node} is STALE: no sealing or checkpoint at all"),
            },
            Problem::TreeMismatch {
                node,
                digest_seq,
                why,
            } => write!(
                f,
                "Merkle tree of node {node} does NOT MATCH digest {digest_seq}: {why}"
            ),
            Problem::TileMissing { path } => {
                write!(f, "transparency-log file {} is MISSING", path.display())
            }
            Problem::TileModified { path } => write!(
                f,
                "tile {} was MODIFIED (not the hashes of the sealed records)",
                path.display()
            ),
            Problem::NotWitnessed { node, why } => {
                write!(f, "node {node}'s tree is NOT WITNESSED: {why}")
            }
            Problem::TreeCheckpointInvalid { node, why } => {
                write!(
                    f,
                    "the signed tree checkpoint of node {node} is INVALID: {why}"
                )
            }
        }
    }
}

/// What [`verify`] found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub valid_digests: usize,
    pub valid_files: usize,
    pub problems: Vec<Problem>,
    /// Unsealed live-segment files (recoverable, not covered by any digest; not an error).
    pub live_segments: Vec<PathBuf>,
    /// Sealed files that a verified digest names (what readers may use).
    pub verified_files: Vec<PathBuf>,
    /// Every Parquet file present under the root, verified or not (what a reader that was asked
    /// to include unverified data reads).
    pub parquet_files: Vec<PathBuf>,
    /// Checkpoints held against the chains (valid, signed by their node's key), and where the
    /// newest of each node was found.
    pub checkpoints: usize,
    pub newest_checkpoints: BTreeMap<u32, String>,
    /// Each node's Merkle tree, as rebuilt from its sealed records.
    pub trees: BTreeMap<u32, crate::tree_store::TreeStatus>,
}

/// What [`verify_store_expecting`] holds a root to beyond its own content.
#[derive(Clone, Debug, Default)]
pub struct Expect {
    /// Checkpoints obtained outside the root (a file, a URL, a log collector's lines), with
    /// where each came from. Those the root itself holds (`_checkpoints/`, and `checkpoint`
    /// rows in its verified `node_events`: other nodes' logs) are always read too.
    pub checkpoints: Vec<(crate::checkpoint::Checkpoint, String)>,
    /// Nodes whose log must be in the root.
    pub nodes: Vec<u32>,
    /// Every node's newest sealing or checkpoint must be at most this old at this time.
    pub freshness: Option<Freshness>,
    /// The expected key of particular nodes (over the one key `verify` is given for all):
    /// a root that holds other nodes' logs — a peer's, the witness's — is verified with each
    /// one's own key, so the checkpoints they keep count.
    pub node_keys: BTreeMap<u32, VerifyingKey>,
    /// Every node's tree must have a checkpoint cosigned by this many of these tlog witnesses.
    pub witnesses: Option<crate::tree_store::WitnessPolicy>,
}

/// The staleness rule of [`Expect`].
#[derive(Clone, Copy, Debug)]
pub struct Freshness {
    pub now_wall_ns: i64,
    pub max_age: std::time::Duration,
}

/// What one node's chain showed (for the checkpoint checks).
#[derive(Debug, Default)]
struct NodeChain {
    /// digest_seq → SHA-256 of its file, for every readable digest.
    digests: BTreeMap<u64, String>,
    last_sealed_wall_ns: Option<i64>,
    key: Option<VerifyingKey>,
    /// The digests, in chain order, while every one so far is authentic and linked (the tree
    /// is rebuilt from these).
    bodies: Vec<DigestBody>,
    /// A digest failed a check: the tree is not rebuilt.
    broken: bool,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Why a [`LogStore`] could not list or read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {why}")]
pub struct StoreError {
    /// What could not be read, as the store names it (a path or a URL).
    pub path: String,
    pub why: String,
}

/// Where an audit root's files are, as [`verify_store`] reads them: a flat namespace of objects
/// named by `/`-separated paths relative to the root (directories are only prefixes, as in an
/// object store). Implemented here for a directory ([`LocalStore`]) and by the query crate for
/// object stores.
pub trait LogStore {
    /// Every object under `prefix` (`""` for all; else a path ending in `/`), at any depth, by
    /// its path relative to the root, in no particular order. A prefix with nothing under it is
    /// an empty list, not an error.
    fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError>;
    /// The whole object.
    fn read(&self, path: &str) -> Result<Vec<u8>, StoreError>;
    /// SHA-256 (hex) and size of an object. The default reads it whole; stores that can stream
    /// should override it.
    fn sha256(&self, path: &str) -> Result<(String, u64), StoreError> {
        let b = self.read(path)?;
        Ok((hex(&Sha256::digest(&b)), b.len() as u64))
    }
    /// How reports name an object: `<root>/<path>` (a filesystem path, or a URL held in a
    /// `PathBuf`, e.g. `s3://bucket/prefix/<path>`).
    fn locate(&self, path: &str) -> PathBuf;
}

/// An audit root that is a local directory.
#[derive(Clone, Debug)]
pub struct LocalStore {
    root: PathBuf,
}

impl LocalStore {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }
}

/// How deep listing descends below the root. The layout is at most four levels deep
/// (`<table>/node=<n>/date=<d>/<file>`); the bound turns a directory-symlink loop into an error
/// instead of an endless walk.
const MAX_DEPTH: usize = 16;

impl LogStore for LocalStore {
    fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let mut out = Vec::new();
        let top = prefix.trim_end_matches('/').to_owned();
        let mut stack = vec![(self.root.join(&top), top, 0usize)];
        while let Some((dir, rel, depth)) = stack.pop() {
            let err = |e: std::io::Error| StoreError {
                path: dir.display().to_string(),
                why: e.to_string(),
            };
            let rd = match fs::read_dir(&dir) {
                Ok(rd) => rd,
                // Not there (never created, or removed while listing: the writer renames
                // temporary files): nothing under it, as in an object store.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(err(e)),
            };
            for e in rd {
                let e = e.map_err(err)?;
                // Names the writer does not produce (non-UTF-8) still show, lossily, so that
                // they are reported.
                let name = e.file_name().to_string_lossy().into_owned();
                let child = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                let p = e.path();
                if p.is_dir() {
                    if depth + 1 >= MAX_DEPTH {
                        return Err(StoreError {
                            path: p.display().to_string(),
                            why: format!(
                                "more than {MAX_DEPTH} directory levels (a symlink loop?)"
                            ),
                        });
                    }
                    stack.push((p, child, depth + 1));
                } else {
                    out.push(child);
                }
            }
        }
        Ok(out)
    }

    fn read(&self, path: &str) -> Result<Vec<u8>, StoreError> {
        let p = self.root.join(path);
        fs::read(&p).map_err(|e| StoreError {
            path: p.display().to_string(),
            why: e.to_string(),
        })
    }

    fn sha256(&self, path: &str) -> Result<(String, u64), StoreError> {
        let p = self.root.join(path);
        sha256_file(&p).map_err(|e| StoreError {
            path: p.display().to_string(),
            why: e.to_string(),
        })
    }

    fn locate(&self, path: &str) -> PathBuf {
        self.root.join(path)
    }
}

/// Verify every node's digest chain under `root` (optionally only digests sealed in
/// `[from_ns, to_ns)`), checking signatures against `key` when given (else against the key the
/// first digest of each node names — trust on first use, reported by the CLI).
///
/// A directory that cannot be listed is reported as [`Problem::Unreadable`] (nothing else can be
/// said then); [`verify_store`] returns it as an error instead.
pub fn verify(
    root: &Path,
    key: Option<&VerifyingKey>,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
) -> Report {
    verify_reporting(
        &LocalStore::new(root),
        key,
        from_ns,
        to_ns,
        &Expect::default(),
    )
}

/// [`verify_store`], with a store that cannot be listed reported as [`Problem::Unreadable`].
pub fn verify_reporting(
    store: &dyn LogStore,
    key: Option<&VerifyingKey>,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
    expect: &Expect,
) -> Report {
    verify_store_expecting(store, key, from_ns, to_ns, expect).unwrap_or_else(|e| Report {
        problems: vec![Problem::Unreadable {
            path: PathBuf::from(e.path),
            why: e.why,
        }],
        ..Report::default()
    })
}

/// [`verify`] over any [`LogStore`]: every digest is read, and every sealed file in range is
/// hashed, through the store. Paths in the report are [`LogStore::locate`]'s. Fails only when the
/// store cannot be listed; an object that cannot be read is a [`Problem`].
pub fn verify_store(
    store: &dyn LogStore,
    key: Option<&VerifyingKey>,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
) -> Result<Report, StoreError> {
    verify_store_expecting(store, key, from_ns, to_ns, &Expect::default())
}

/// [`verify_store`], and the root held to `expect` and to every checkpoint it can find: a
/// chain cut before a checkpoint's digest, a digest that is not the one its checkpoint hashed,
/// a missing node, a stale node, and an empty root are [`Problem`]s.
pub fn verify_store_expecting(
    store: &dyn LogStore,
    key: Option<&VerifyingKey>,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
    expect: &Expect,
) -> Result<Report, StoreError> {
    let mut r = Report::default();
    let mut chains: BTreeMap<u32, NodeChain> = BTreeMap::new();
    let mut objects = store.list("")?;
    objects.sort();
    let mut named: BTreeMap<PathBuf, (String, u64)> = BTreeMap::new();
    let mut in_range_files: BTreeSet<PathBuf> = BTreeSet::new();
    // `_digests/node=<n>/<digest_seq>.json`, per node directory in name order, each node's
    // digests in name order (the zero-padded `digest_seq`).
    let mut nodes: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for o in &objects {
        let mut parts = o.split('/');
        if let (Some("_digests"), Some(node_dir), Some(name), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
            && Path::new(name).extension().is_some_and(|x| x == "json")
        {
            nodes.entry(node_dir).or_default().push(o);
        }
    }
    for (node_dir, files) in nodes {
        let node: u32 = node_dir
            .strip_prefix("node=")
            .and_then(|n| n.parse().ok())
            .unwrap_or(u32::MAX);
        let mut prev: Option<(String, String, u64, u64)> = None; // (sha, signature, digest_seq, seq_end)
        let expected: Option<VerifyingKey> = expect.node_keys.get(&node).copied().or(key.copied());
        let mut node_key: Option<VerifyingKey> = expected;
        for rel in files {
            let path = store.locate(rel);
            let bytes = match store.read(rel) {
                Ok(b) => b,
                Err(e) => {
                    r.problems.push(Problem::DigestUnreadable {
                        digest: path,
                        why: e.why,
                    });
                    continue;
                }
            };
            let d: DigestFile = match serde_json::from_slice(&bytes) {
                Ok(d) => d,
                Err(e) => {
                    r.problems.push(Problem::DigestUnreadable {
                        digest: path,
                        why: e.to_string(),
                    });
                    prev = None;
                    continue;
                }
            };
            let sha = hex(&Sha256::digest(&bytes));
            let chain = chains.entry(node).or_default();
            chain.digests.insert(d.body.digest_seq, sha.clone());
            chain.last_sealed_wall_ns = chain.last_sealed_wall_ns.max(Some(d.body.sealed_wall_ns));
            let mut ok = true;
            // Signature.
            let vk = match node_key {
                Some(k) => Some(k),
                None => unhex(&d.body.public_key)
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .and_then(|b| VerifyingKey::from_bytes(&b).ok()),
            };
            node_key = node_key.or(vk);
            chains.entry(node).or_default().key = node_key;
            let sig_ok = vk.is_some_and(|vk| {
                unhex(&d.signature)
                    .and_then(|s| <[u8; 64]>::try_from(s).ok())
                    .is_some_and(|s| {
                        vk.verify(&canonical(&d.body), &Signature::from_bytes(&s))
                            .is_ok()
                    })
            });
            if !sig_ok {
                r.problems.push(Problem::BadSignature {
                    digest: path.clone(),
                });
                ok = false;
            } else if let Some(k) = expected
                && hex(k.as_bytes()) != d.body.public_key
            {
                r.problems.push(Problem::WrongKey {
                    digest: path.clone(),
                    key: d.body.public_key.clone(),
                });
                ok = false;
            }
            // Only an authentic digest (signed by the expected key) vouches for its files: the
            // files of any other are neither valid nor readable as verified (their digest's
            // problem is reported; they are not "extra" either — a digest names them).
            let authentic = ok;
            // Chain link and order.
            match &prev {
                None => {
                    if d.body.digest_seq != 0 && d.body.previous_digest_sha256.is_some() {
                        r.problems.push(Problem::DigestMissing {
                            node,
                            digest_seq: d.body.digest_seq - 1,
                        });
                        ok = false;
                    }
                }
                Some((psha, psig, pseq, pend)) => {
                    if d.body.digest_seq != pseq + 1 {
                        if d.body.digest_seq > pseq + 1 {
                            for missing in pseq + 1..d.body.digest_seq {
                                r.problems.push(Problem::DigestMissing {
                                    node,
                                    digest_seq: missing,
                                });
                            }
                        } else {
                            r.problems.push(Problem::DigestOutOfOrder {
                                digest: path.clone(),
                                expected_seq: pseq + 1,
                                found_seq: d.body.digest_seq,
                            });
                        }
                        ok = false;
                    }
                    if d.body.previous_digest_sha256.as_deref() != Some(psha.as_str())
                        || d.body.previous_signature.as_deref() != Some(psig.as_str())
                    {
                        r.problems.push(Problem::ChainBroken {
                            digest: path.clone(),
                            why: "previous-digest hash or signature does not match the digest before it".into(),
                        });
                        ok = false;
                    }
                    if d.body.seq_start != *pend {
                        r.problems.push(Problem::SequenceGap {
                            node,
                            expected: *pend,
                            found: d.body.seq_start,
                        });
                        ok = false;
                    }
                }
            }
            let rows: u64 =
                d.body.files.iter().map(|f| f.rows).sum::<u64>() + d.body.lost_unacknowledged;
            if rows != d.body.seq_end.saturating_sub(d.body.seq_start) {
                r.problems.push(Problem::RowsMismatch {
                    digest: path.clone(),
                    accounted: rows,
                    range: d.body.seq_end - d.body.seq_start,
                });
                ok = false;
            }
            let in_range = from_ns.is_none_or(|f| d.body.sealed_wall_ns >= f)
                && to_ns.is_none_or(|t| d.body.sealed_wall_ns < t);
            for f in &d.body.files {
                let p = store.locate(&f.path);
                // What an authentic digest says of a path is never overridden by another digest.
                if authentic || !named.contains_key(&p) {
                    named.insert(p.clone(), (f.sha256.clone(), f.bytes));
                }
                if in_range && authentic {
                    in_range_files.insert(p);
                }
            }
            if ok && in_range {
                r.valid_digests += 1;
            }
            let chain = chains.entry(node).or_default();
            if ok {
                chain.bodies.push(d.body.clone());
            } else {
                chain.broken = true;
            }
            prev = Some((sha, d.signature.clone(), d.body.digest_seq, d.body.seq_end));
        }
    }
    // Files: every named file must be intact; every sealed file must be named. Only the files in
    // range are hashed (through the store); the others need only be listed.
    let present: BTreeMap<PathBuf, &str> = objects
        .iter()
        .filter(|o| Path::new(o).extension().is_some_and(|x| x == "parquet"))
        .map(|o| (store.locate(o), o.as_str()))
        .collect();
    let by_sha_all: BTreeMap<String, PathBuf> = named
        .iter()
        .map(|(p, (s, _))| (s.clone(), p.clone()))
        .collect();
    for p in &in_range_files {
        let (sha, bytes) = &named[p];
        let Some(rel) = present.get(p) else {
            r.problems.push(Problem::FileMissing { path: p.clone() });
            continue;
        };
        match store.sha256(rel) {
            Err(e) => r.problems.push(Problem::Unreadable {
                path: p.clone(),
                why: e.why,
            }),
            Ok((s, _)) if s == *sha => {
                r.valid_files += 1;
                r.verified_files.push(p.clone());
            }
            Ok((s, n)) => {
                if let Some(orig) = by_sha_all.get(&s).filter(|o| *o != p) {
                    r.problems.push(Problem::FileReordered {
                        path: p.clone(),
                        holds_content_of: orig.clone(),
                    });
                } else if n < *bytes {
                    r.problems.push(Problem::FileTruncated {
                        path: p.clone(),
                        sealed_bytes: *bytes,
                        found_bytes: n,
                    });
                } else {
                    r.problems.push(Problem::FileModified { path: p.clone() });
                }
            }
        }
    }
    for p in present.keys() {
        if !named.contains_key(p) {
            r.problems.push(Problem::FileExtra { path: p.clone() });
        }
    }
    let verified_node_events: Vec<&str> = r
        .verified_files
        .iter()
        .filter_map(|p| present.get(p).copied())
        .filter(|rel| rel.starts_with("node_events/"))
        .collect();
    check_trees(
        store,
        &chains,
        from_ns.is_some() || to_ns.is_some(),
        expect.witnesses.as_ref(),
        &mut r,
    );
    check_checkpoints(
        store,
        &objects,
        &verified_node_events,
        &chains,
        key,
        expect,
        &mut r,
    );
    r.parquet_files = present.into_keys().collect();
    r.live_segments = objects
        .iter()
        .filter(|o| Path::new(o).extension().is_some_and(|x| x == "arrows"))
        .map(|o| store.locate(o))
        .collect();
    Ok(r)
}

/// Rebuilds each node's Merkle tree from its sealed records ([`crate::tree_store::verify_tree`]),
/// when its chain and files hold (else the problems already say why) and the whole chain is
/// read (not a time window: the tree starts at the node's first record).
fn check_trees(
    store: &dyn LogStore,
    chains: &BTreeMap<u32, NodeChain>,
    windowed: bool,
    witnesses: Option<&crate::tree_store::WitnessPolicy>,
    r: &mut Report,
) {
    use crate::tree_store::TreeStatus;
    let verified: BTreeSet<&PathBuf> = r.verified_files.iter().collect();
    for (&node, chain) in chains {
        let status = if windowed {
            if witnesses.is_some() {
                r.problems.push(Problem::NotWitnessed {
                    node,
                    why: "not checked: a time window was asked for".into(),
                });
            }
            TreeStatus::NotChecked("a time window was asked for (the tree covers the whole log)")
        } else if chain.broken {
            TreeStatus::NotChecked("the digest chain does not hold")
        } else if !chain
            .bodies
            .iter()
            .flat_map(|d| &d.files)
            .all(|f| verified.contains(&store.locate(&f.path)))
        {
            TreeStatus::NotChecked("a sealed file does not hold")
        } else if let Some(key) = chain.key {
            crate::tree_store::verify_tree(
                store,
                node,
                &chain.bodies,
                &key,
                witnesses,
                &mut r.problems,
            )
        } else {
            TreeStatus::NotChecked("no key")
        };
        r.trees.insert(node, status);
    }
}

/// Every checkpoint the root holds or `expect` brings, by where it was found: the root's own
/// copies (`_checkpoints/*.json`), `checkpoint` rows in its verified `node_events` files (the
/// logs of other nodes that kept them), then the expected ones.
fn gather_checkpoints(
    store: &dyn LogStore,
    objects: &[String],
    verified_node_events: &[&str],
    expect: &Expect,
    r: &mut Report,
) -> Vec<(Checkpoint, String)> {
    let mut found = Vec::new();
    let mut take = |text: &str, place: String, r: &mut Report| {
        for cp in Checkpoint::parse_all(text) {
            match cp {
                Ok(cp) => found.push((cp, place.clone())),
                Err(e) => r.problems.push(Problem::CheckpointInvalid {
                    place: place.clone(),
                    why: e.to_string(),
                }),
            }
        }
    };
    for o in objects
        .iter()
        .filter(|o| o.starts_with("_checkpoints/") && o.ends_with(".json"))
    {
        let place = store.locate(o).display().to_string();
        match store.read(o) {
            Ok(b) => take(&String::from_utf8_lossy(&b), place, r),
            Err(e) => r.problems.push(Problem::Unreadable {
                path: store.locate(o),
                why: e.why,
            }),
        }
    }
    for rel in verified_node_events {
        let place = store.locate(rel).display().to_string();
        match store
            .read(rel)
            .map(|b| node_event_details(b, crate::checkpoint::NODE_EVENT_KIND))
        {
            Ok(Ok(details)) => {
                for d in details {
                    take(&d, place.clone(), r);
                }
            }
            Ok(Err(why)) | Err(StoreError { why, .. }) => r.problems.push(Problem::Unreadable {
                path: store.locate(rel),
                why,
            }),
        }
    }
    found.extend(expect.checkpoints.iter().cloned());
    found
}

/// The `detail` of every `node_events` row of kind `kind` in a sealed Parquet file.
fn node_event_details(file: Vec<u8>, kind: &str) -> Result<Vec<String>, String> {
    use arrow::array::{Array, AsArray};
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
        bytes::Bytes::from(file),
    )
    .and_then(|b| b.build())
    .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| e.to_string())?;
        let (Some(ev), Some(detail)) = (
            batch.column_by_name("event"),
            batch.column_by_name("detail"),
        ) else {
            return Err("not a node_events file (no event/detail columns)".into());
        };
        let (ev, detail) = (ev.as_string::<i32>(), detail.as_string::<i32>());
        for i in 0..batch.num_rows() {
            if ev.is_valid(i) && ev.value(i) == kind && detail.is_valid(i) {
                out.push(detail.value(i).to_owned());
            }
        }
    }
    Ok(out)
}

/// Hold every node's chain to its newest valid checkpoint, and the root to `expect`.
fn check_checkpoints(
    store: &dyn LogStore,
    objects: &[String],
    verified_node_events: &[&str],
    chains: &BTreeMap<u32, NodeChain>,
    key: Option<&VerifyingKey>,
    expect: &Expect,
    r: &mut Report,
) {
    // Per node: the valid checkpoint with the newest digest, and the newest issue time.
    let mut newest: BTreeMap<u32, (Checkpoint, String)> = BTreeMap::new();
    let mut latest_issue: BTreeMap<u32, i64> = BTreeMap::new();
    for (cp, place) in gather_checkpoints(store, objects, verified_node_events, expect, r) {
        let node = cp.body.node;
        // The node's key: the expected one, else its chain's, else (no chain left) its own.
        let node_key = expect
            .node_keys
            .get(&node)
            .copied()
            .or(key.copied())
            .or(chains.get(&node).and_then(|c| c.key));
        match cp.verify(node_key.as_ref()) {
            Ok(()) => {}
            // Signed by another key: it vouches for nothing about this node (not evidence).
            Err(CheckpointError::WrongKey { .. }) => continue,
            Err(e) => {
                r.problems.push(Problem::CheckpointInvalid {
                    place,
                    why: e.to_string(),
                });
                continue;
            }
        }
        r.checkpoints += 1;
        let issued = latest_issue.entry(node).or_insert(i64::MIN);
        *issued = (*issued).max(cp.body.issued_wall_ns);
        let better = newest.get(&node).is_none_or(|(b, _)| {
            (cp.body.digest_seq, cp.body.issued_wall_ns)
                > (b.body.digest_seq, b.body.issued_wall_ns)
        });
        if better {
            newest.insert(node, (cp, place));
        }
    }
    if chains.is_empty() {
        r.problems.push(Problem::EmptyRoot);
    }
    for (node, (cp, place)) in &newest {
        r.newest_checkpoints.insert(*node, place.clone());
        let (Some(want), Some(sha)) = (cp.body.digest_seq, cp.body.digest_sha256.as_ref()) else {
            continue; // issued before the node's first seal: nothing to hold the chain to
        };
        let digests = chains.get(node).map(|c| &c.digests);
        let last_present = digests.and_then(|d| d.keys().next_back().copied());
        match digests.and_then(|d| d.get(&want)) {
            Some(have) if have != sha => r.problems.push(Problem::CheckpointMismatch {
                node: *node,
                digest_seq: want,
                place: place.clone(),
            }),
            Some(_) => {}
            // Missing below the chain's end is a `DigestMissing` already; past it, a cut tail.
            None if last_present.is_none_or(|last| last < want) => {
                r.problems.push(Problem::TailCut {
                    node: *node,
                    checkpoint_digest_seq: want,
                    last_present,
                    place: place.clone(),
                })
            }
            None => {}
        }
    }
    // A node is present through its own chain, or through a checkpoint that vouches for sealed
    // data of it (then a missing chain is a cut tail, reported above). A checkpoint issued before
    // the node's first seal (`digest_seq` null) proves nothing is there: with one key for all
    // nodes, any node could have signed it (docs/audit-schema.md).
    for &node in &expect.nodes {
        let vouched = newest
            .get(&node)
            .is_some_and(|(cp, _)| cp.body.digest_seq.is_some());
        if !chains.contains_key(&node) && !vouched {
            r.problems.push(Problem::NodeMissing { node });
        }
    }
    if let Some(f) = expect.freshness {
        let nodes: BTreeSet<u32> = chains
            .keys()
            .chain(newest.keys())
            .chain(expect.nodes.iter())
            .copied()
            .collect();
        let oldest_ok = f.now_wall_ns.saturating_sub(f.max_age.as_nanos() as i64);
        for node in nodes {
            let sealed = chains.get(&node).and_then(|c| c.last_sealed_wall_ns);
            let last = sealed.max(latest_issue.get(&node).copied());
            if last.is_none_or(|t| t < oldest_ok) {
                r.problems.push(Problem::Stale {
                    node,
                    last_evidence_wall_ns: last,
                    max_age_s: f.max_age.as_secs(),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::writer::{AuditWriter, WriterConfig};
    use crate::{AuditSink, Event, PageKind};

    /// A store that is a map of names to bytes: what `verify_store` needs of any store.
    struct MemStore(BTreeMap<String, Vec<u8>>);

    impl LogStore for MemStore {
        fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
            Ok(self
                .0
                .keys()
                .filter(|k| k.starts_with(prefix))
                .cloned()
                .collect())
        }
        fn read(&self, path: &str) -> Result<Vec<u8>, StoreError> {
            self.0.get(path).cloned().ok_or_else(|| StoreError {
                path: path.to_owned(),
                why: "no such object".into(),
            })
        }
        fn locate(&self, path: &str) -> PathBuf {
            PathBuf::from(format!("mem://log/{path}"))
        }
    }

    #[test]
    fn verification_through_any_store_matches_the_directory() {
        let dir = std::env::temp_dir().join(format!("custody-digest-store-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let key = generate_key().expect("key");
        let w = AuditWriter::open(WriterConfig::new(&dir, 4, key.clone())).expect("writer");
        for i in 0..60u64 {
            w.record(Event::Page {
                ts_ns: crate::mono_now_ns(),
                request: i,
                tenant: "t".into(),
                page: (i % 7) as u32,
                generation: 1,
                kind: PageKind::Alloc,
            })
            .expect("record");
            if i % 20 == 19 {
                w.rotate().expect("rotate");
            }
        }
        w.close().expect("close");
        let local = LocalStore::new(&dir);
        let mut names = local.list("").expect("list");
        names.sort();
        assert!(names.iter().any(|n| n.starts_with("_digests/node=4/")));
        let digests = local.list("_digests/").expect("list prefix");
        assert!(!digests.is_empty() && digests.iter().all(|n| n.starts_with("_digests/")));
        assert!(local.list("no-such-dir/").expect("absent").is_empty());

        let vk = key.verifying_key();
        let on_disk = verify(&dir, Some(&vk), None, None);
        assert!(on_disk.ok(), "{:?}", on_disk.problems);
        assert_eq!(on_disk.valid_digests, 3);
        let mut mem = MemStore(
            names
                .iter()
                .map(|n| (n.clone(), local.read(n).expect("read")))
                .collect(),
        );
        let r = verify_store(&mem, Some(&vk), None, None).expect("verify");
        assert!(r.ok(), "{:?}", r.problems);
        assert_eq!(
            (r.valid_digests, r.valid_files, r.verified_files.len()),
            (
                on_disk.valid_digests,
                on_disk.valid_files,
                on_disk.verified_files.len()
            )
        );
        assert!(
            r.verified_files
                .iter()
                .all(|p| p.to_string_lossy().starts_with("mem://log/"))
        );
        // Tampering in the store is found through the store.
        let victim = names
            .iter()
            .find(|n| n.ends_with(".parquet"))
            .expect("a sealed file")
            .clone();
        let bytes = mem.0.get_mut(&victim).expect("object");
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        let r = verify_store(&mem, Some(&vk), None, None).expect("verify");
        assert_eq!(
            r.problems,
            vec![Problem::FileModified {
                path: mem.locate(&victim)
            }]
        );
        assert_eq!(r.verified_files.len(), on_disk.verified_files.len() - 1);
        assert_eq!(r.parquet_files.len(), on_disk.parquet_files.len());
        let _ = fs::remove_dir_all(&dir);
    }
}

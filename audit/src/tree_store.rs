//! A node's Merkle tree on disk, and its check.
//!
//! ```text
//! _tlog/node=<n>/checkpoint          C2SP tlog-checkpoint in a signed note (the node's key)
//! _tlog/node=<n>/tile/<L>/<N>        C2SP tlog-tiles: full tiles (256 hashes), immutable
//! _tlog/node=<n>/tile/<L>/<N>.p/<W>  partial tiles, removed once their full tile is written
//! ```
//! Written by the writer at every seal before the digest that commits to the tree (size and
//! root), so a digest never names a tree whose tiles are not on disk. The tree is rebuilt by
//! `verify` from the sealed Parquet alone ([`verify_tree`]): tiles, digests and checkpoint must
//! all agree with the records.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use arrow::record_batch::RecordBatch;
use ed25519_dalek::VerifyingKey;
use tlog_tiles::{Hash, record_hash};

use crate::digest::{self, ChainHead, DigestBody, DigestFile, LocalStore, LogStore, Problem};
use crate::leaf::{self, LeafError};
use crate::schema::Table;
use crate::tlog::{self, EdgeTree, TileFile, TlogError};
pub use crate::tlog_witness::{HttpReply, TransportError, WitnessTarget, WitnessTransport};

/// The tree's directory under an audit root.
pub const TLOG_DIR: &str = "_tlog";

/// `_tlog/node=<n>`: a node's tree, relative to the root.
pub fn node_prefix(node: u32) -> String {
    format!("{TLOG_DIR}/node={node}")
}

/// The origin (and note key name) a node's checkpoints carry unless one is configured: a
/// schema-less URL under the reserved `.invalid` domain (it names a log, resolves nowhere),
/// with the node id and the start of its public key, so two nodes or two keys never share one.
pub fn default_origin(node: u32, key: &VerifyingKey) -> String {
    format!(
        "custody.invalid/audit/node-{node}/{}",
        digest::hex(&key.as_bytes()[..4])
    )
}

#[derive(Debug, thiserror::Error)]
pub enum TreeStoreError {
    #[error("the transparency log at {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the transparency log: {0}")]
    Tlog(#[from] TlogError),
    #[error("the transparency log's leaves: {0}")]
    Leaf(#[from] LeafError),
    #[error(
        "node {node}: the tiles on disk make a tree of {size} records whose root is not the one its newest digest signed (tiles altered, or a disk from another log)"
    )]
    RootMismatch { node: u32, size: u64 },
    #[error("rebuilding the tree from sealed files: {0}")]
    Rebuild(String),
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> TreeStoreError + '_ {
    move |source| TreeStoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A node's tree directory on a local disk (the writer's side).
#[derive(Debug, Clone)]
pub struct TreeDir {
    dir: PathBuf,
}

impl TreeDir {
    pub fn new(root: &Path, node: u32) -> Self {
        Self {
            dir: root.join(node_prefix(node)),
        }
    }

    /// Writes tiles durably: each to a temporary name, renamed, then one `syncfs` for them all
    /// (a seal writes a tile per 256 records: an fsync each cost the writer ~1 µs per event).
    /// A full tile replaces the partial versions of itself; full level-0 tiles are written only
    /// if `full_level0` (their partial versions are removed either way).
    pub fn write_tiles(&self, tiles: &[TileFile], full_level0: bool) -> Result<(), TreeStoreError> {
        if tiles.is_empty() {
            return Ok(());
        }
        for t in tiles {
            if full_level0 || !tlog::is_full_level0(&t.path) {
                write_renamed(&self.dir.join(&t.path), &t.bytes)?;
            }
            if !t.path.contains(".p/") {
                let partials = self.dir.join(format!("{}.p", t.path));
                match fs::remove_dir_all(&partials) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_at(&partials)(e)),
                }
            }
        }
        syncfs(&self.dir)
    }

    /// The partial tiles of a tree of `size` records, as [`EdgeTree::from_partials`] takes them.
    pub fn read_partials(&self, size: u64) -> Result<Vec<Vec<u8>>, TreeStoreError> {
        let mut out = Vec::new();
        for level in 0..EdgeTree::levels(size) as u8 {
            let width = EdgeTree::partial_width(size, level);
            if width == 0 {
                out.push(Vec::new());
                continue;
            }
            let shift = (u32::from(level) + 1) * u32::from(tlog::TILE_HEIGHT);
            let index = if shift >= 64 { 0 } else { size >> shift };
            let path = self.dir.join(tlog::tile_path(level, index, Some(width)));
            out.push(fs::read(&path).map_err(io_at(&path))?);
        }
        Ok(out)
    }

    /// Writes the newest signed checkpoint note durably.
    pub fn write_checkpoint(&self, note: &[u8]) -> Result<(), TreeStoreError> {
        write_durably(&self.dir.join("checkpoint"), note)
    }
}

fn fsync_dir(dir: &Path) -> Result<(), TreeStoreError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_at(dir))
}

/// Writes `bytes` to a temporary name and renames it over `path` (atomic, not yet durable).
fn write_renamed(path: &Path, bytes: &[u8]) -> Result<(), TreeStoreError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_at(dir))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("tile");
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, bytes)
        .and_then(|()| fs::rename(&tmp, path))
        .map_err(io_at(path))
}

/// Writes `path` durably: renamed into place, fsynced, its directory fsynced.
fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), TreeStoreError> {
    write_renamed(path, bytes)?;
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_at(path))?;
    fsync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Flushes the file system holding `dir` (data and metadata of every file written to it).
fn syncfs(dir: &Path) -> Result<(), TreeStoreError> {
    use std::os::fd::AsRawFd;
    let d = fs::File::open(dir).map_err(io_at(dir))?;
    // SAFETY: `syncfs` reads only the descriptor, which `d` keeps open for the call.
    if unsafe { libc::syncfs(d.as_raw_fd()) } != 0 {
        return Err(io_at(dir)(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The writer's tree at start: the edge the newest digest's tree left on disk (its root checked
/// against the digest's), an empty tree for a new log, or — for a log sealed before the tree
/// existed — the tree rebuilt from its sealed files (each checked against its digest first),
/// its tiles written.
pub fn open_tree(root: &Path, node: u32, chain: &ChainHead) -> Result<EdgeTree, TreeStoreError> {
    let dir = TreeDir::new(root, node);
    if let Some(head) = chain.tree {
        let from_disk = dir
            .read_partials(head.size)
            .and_then(|p| Ok(EdgeTree::from_partials(head.size, p)?));
        let tree = match from_disk {
            Ok(t) if t.root()?.0 == head.root => t,
            // A crash after a seal's tiles but before its digest leaves the edge of a later
            // tree (its partial tiles replaced): the sealed records still make this one.
            other => {
                tracing::warn!(node, size = head.size, error = ?other.err(), "the tree's edge on disk is not the newest digest's: rebuilding it from the sealed files");
                rebuild(root, node)?
            }
        };
        if tree.root()?.0 != head.root || tree.size() != head.size || head.size != chain.next_seq {
            return Err(TreeStoreError::RootMismatch {
                node,
                size: head.size,
            });
        }
        return Ok(tree);
    }
    if chain.next_seq == 0 {
        return Ok(EdgeTree::new());
    }
    tracing::warn!(
        node,
        records = chain.next_seq,
        "audit log sealed before its Merkle tree existed: rebuilding the tree from the sealed files"
    );
    rebuild(root, node)
}

/// Rebuilds a node's tree from its sealed files (each checked against its digest first) and
/// writes every tile: for a log sealed before the tree existed, or tiles lost or deleted.
/// Tiles are hashes of the records, so anyone holding the records can write them; what only
/// the node can write is the signed checkpoint, which this leaves alone.
pub fn rebuild(root: &Path, node: u32) -> Result<EdgeTree, TreeStoreError> {
    let dir = TreeDir::new(root, node);
    let store = LocalStore::new(root);
    let mut tree = EdgeTree::new();
    for d in node_digests(&store, node).map_err(|e| TreeStoreError::Rebuild(e.to_string()))? {
        for f in &d.files {
            let (sha, _) = store
                .sha256(&f.path)
                .map_err(|e| TreeStoreError::Rebuild(e.to_string()))?;
            if sha != f.sha256 {
                return Err(TreeStoreError::Rebuild(format!(
                    "{} is not the file digest {} sealed: run `custody audit verify`",
                    f.path, d.digest_seq
                )));
            }
        }
        let batches = digest_batches(&store, &d).map_err(TreeStoreError::Rebuild)?;
        append_digest(&mut tree, &d, &batches)?;
        dir.write_tiles(&tree.take_full_tiles(), true)?;
    }
    dir.write_tiles(&tree.partial_tiles(0), true)?;
    Ok(tree)
}

/// Appends a digest's records to `tree` (which must end where the digest starts).
fn append_digest(
    tree: &mut EdgeTree,
    d: &DigestBody,
    batches: &[(Table, RecordBatch)],
) -> Result<(), TreeStoreError> {
    let leaves = leaf::segment_leaves(
        d.node,
        d.seq_start,
        d.seq_end,
        batches.iter().map(|(t, b)| (*t, b)),
    )?;
    for l in leaves {
        tree.append_leaf(l)?;
    }
    Ok(())
}

/// A node's digests in chain order, as stored (no checks: `verify`'s job).
fn node_digests(store: &dyn LogStore, node: u32) -> Result<Vec<DigestBody>, digest::StoreError> {
    let mut names = store.list(&format!("_digests/node={node}/"))?;
    names.retain(|n| n.ends_with(".json"));
    names.sort();
    names
        .iter()
        .map(|n| {
            let bytes = store.read(n)?;
            serde_json::from_slice::<DigestFile>(&bytes)
                .map(|d| d.body)
                .map_err(|e| digest::StoreError {
                    path: n.clone(),
                    why: e.to_string(),
                })
        })
        .collect()
}

/// Every record batch of the files a digest names, with their tables.
fn digest_batches(
    store: &dyn LogStore,
    d: &DigestBody,
) -> Result<Vec<(Table, RecordBatch)>, String> {
    let mut out = Vec::new();
    for f in &d.files {
        let table = Table::from_name(&f.table)
            .ok_or_else(|| format!("{}: unknown table {:?}", f.path, f.table))?;
        let bytes = store.read(&f.path).map_err(|e| e.to_string())?;
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
            bytes::Bytes::from(bytes),
        )
        .and_then(|b| b.build())
        .map_err(|e| format!("{}: {e}", f.path))?;
        for b in reader {
            out.push((table, b.map_err(|e| format!("{}: {e}", f.path))?));
        }
    }
    Ok(out)
}

/// What `verify` found of a node's tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TreeStatus {
    /// Rebuilt from the sealed records; tiles, digests and checkpoint agree with it.
    Checked {
        size: u64,
        root: String,
        /// The size of the signed checkpoint note found (`None`: none on disk).
        checkpoint_size: Option<u64>,
        /// With `--witness`: the size of the checkpoint enough witnesses cosigned.
        witnessed_size: Option<u64>,
    },
    /// Not rebuilt, and why (a time window; files that failed their own checks).
    NotChecked(&'static str),
    /// No digest of the node commits to a tree (a log sealed before the tree existed).
    Absent,
}

/// Rebuilds a node's tree from its sealed records (`digests`: the node's chain, in order, each
/// authentic and intact — `verify` checks that first) and holds everything written about the
/// tree to it: each digest's size and root, every tile, and the signed checkpoint note.
pub fn verify_tree(
    store: &dyn LogStore,
    node: u32,
    digests: &[DigestBody],
    key: &VerifyingKey,
    witnesses: Option<&WitnessPolicy>,
    problems: &mut Vec<Problem>,
) -> TreeStatus {
    if digests.iter().all(|d| d.tree_size.is_none()) {
        if witnesses.is_some() {
            problems.push(Problem::NotWitnessed {
                node,
                why: "its log has no Merkle tree (sealed before the transparency log)".into(),
            });
        }
        return TreeStatus::Absent;
    }
    let prefix = node_prefix(node);
    let mut tree = EdgeTree::new();
    let mut roots: BTreeMap<u64, Hash> = BTreeMap::new();
    let mut started = false;
    let mismatch = |d: &DigestBody, why: String| Problem::TreeMismatch {
        node,
        digest_seq: d.digest_seq,
        why,
    };
    for d in digests {
        if tree.size() != d.seq_start {
            problems.push(mismatch(
                d,
                format!(
                    "the tree has {} records, the digest starts at seq {}",
                    tree.size(),
                    d.seq_start
                ),
            ));
            return TreeStatus::NotChecked("the chain has a gap");
        }
        let batches = match digest_batches(store, d) {
            Ok(b) => b,
            Err(why) => {
                problems.push(mismatch(d, why));
                return TreeStatus::NotChecked("a sealed file does not decode");
            }
        };
        if let Err(e) = append_digest(&mut tree, d, &batches) {
            problems.push(mismatch(d, e.to_string()));
            return TreeStatus::NotChecked("a sealed file's records are not the digest's");
        }
        check_tiles(store, &prefix, tree.take_full_tiles(), problems);
        let root = match tree.root() {
            Ok(r) => r,
            Err(e) => {
                problems.push(mismatch(d, e.to_string()));
                return TreeStatus::NotChecked("the tree could not be computed");
            }
        };
        roots.insert(tree.size(), root);
        match (d.tree(), d.tree_size.is_some() || d.tree_root.is_some()) {
            (Some(head), _) => {
                started = true;
                if head.size != tree.size() || head.root != root.0 {
                    problems.push(mismatch(
                        d,
                        format!(
                            "it signs a tree of {} records with root {}; the sealed records make {} with root {}",
                            head.size,
                            digest::hex(&head.root),
                            tree.size(),
                            digest::hex(&root.0)
                        ),
                    ));
                }
            }
            (None, true) => problems.push(mismatch(d, "malformed tree_size/tree_root".into())),
            (None, false) if started => problems.push(mismatch(
                d,
                "no tree, after digests that had one (the tree was dropped)".into(),
            )),
            (None, false) => {}
        }
    }
    check_tiles(store, &prefix, tree.partial_tiles(0), problems);
    let checkpoint_size = check_note(store, node, &prefix, key, &roots, problems);
    let witnessed_size =
        witnesses.and_then(|p| check_cosigned(store, node, key, &roots, p, problems));
    let root = roots
        .get(&tree.size())
        .map(|r| digest::hex(&r.0))
        .unwrap_or_default();
    TreeStatus::Checked {
        size: tree.size(),
        root,
        checkpoint_size,
        witnessed_size,
    }
}

/// Every tile must be there and hold the records' hashes — but full level-0 tiles only where
/// present (the writer writes them only with `level0_tiles`; `custody audit tiles` adds them).
fn check_tiles(
    store: &dyn LogStore,
    prefix: &str,
    tiles: Vec<TileFile>,
    problems: &mut Vec<Problem>,
) {
    for t in tiles {
        let rel = format!("{prefix}/{}", t.path);
        match store.read(&rel) {
            Ok(b) if b == t.bytes => {}
            Ok(_) => problems.push(Problem::TileModified {
                path: store.locate(&rel),
            }),
            Err(_) if tlog::is_full_level0(&t.path) => {}
            Err(_) => problems.push(Problem::TileMissing {
                path: store.locate(&rel),
            }),
        }
    }
}

/// The signed checkpoint note: signed by the node's key under the origin it names, for a size
/// some digest sealed, with that size's root. Returns its size when it holds.
fn check_note(
    store: &dyn LogStore,
    node: u32,
    prefix: &str,
    key: &VerifyingKey,
    roots: &BTreeMap<u64, Hash>,
    problems: &mut Vec<Problem>,
) -> Option<u64> {
    // No note is no claim (as a missing `_checkpoints/` copy): whoever can delete files can
    // delete it. The writer writes one at every seal and start, so one is there unless removed.
    let Ok(note) = store.read(&format!("{prefix}/checkpoint")) else {
        return None;
    };
    let invalid = |why: String| Problem::TreeCheckpointInvalid { node, why };
    let origin = note
        .split(|&b| b == b'\n')
        .next()
        .and_then(|l| std::str::from_utf8(l).ok())
        .unwrap_or_default();
    if !signed_note::is_key_name_valid(origin) {
        problems.push(invalid(format!(
            "its origin line {origin:?} is not a key name"
        )));
        return None;
    }
    let vkey = signed_note::new_ed25519_verifier_key(origin, key);
    let cp = match tlog::open_checkpoint(&note, &vkey) {
        Ok(cp) => cp,
        Err(e) => {
            problems.push(invalid(format!("not signed by the node's key: {e}")));
            return None;
        }
    };
    match roots.get(&cp.size()) {
        Some(r) if r == cp.hash() => Some(cp.size()),
        Some(_) => {
            problems.push(invalid(format!(
                "its root for {} records is not the sealed records' (a forked history)",
                cp.size()
            )));
            None
        }
        None => {
            problems.push(invalid(format!(
                "it names a tree of {} records that no digest sealed",
                cp.size()
            )));
            None
        }
    }
}

/// Why a proof could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ProofError {
    #[error("the audit root: {0}")]
    Store(#[from] digest::StoreError),
    #[error(transparent)]
    Tlog(#[from] TlogError),
    #[error("node {node} has no signed tree checkpoint ({path}): nothing to prove against")]
    NoCheckpoint { node: u32, path: String },
    #[error("node {node}: no digest sealed a tree of {size} records")]
    UnsealedSize { node: u32, size: u64 },
    #[error("node {node}: the tiles and records do not make the tree its digests signed: {why}")]
    Inconsistent { node: u32, why: String },
    #[error("node {node}: {why}")]
    Records { node: u32, why: String },
}

/// A node's sealed log as a source of proofs: the tree's tiles from `_tlog/`, its full level-0
/// tiles recomputed from the sealed records where they are not on disk, every tile
/// authenticated against a root a digest signed (`tlog_tiles`' `TileHashReader`) before a proof
/// uses it.
pub struct NodeLog<'a> {
    store: &'a dyn LogStore,
    node: u32,
    digests: Vec<DigestBody>,
    /// The leaves of the segments most recently recomputed from their records, by
    /// `digest_seq` (a receipt's records share one or two segments: one decode for all their
    /// proofs). Bounded by [`LEAF_CACHE_SEGMENTS`].
    leaves: std::sync::Mutex<BTreeMap<u64, std::sync::Arc<Vec<Hash>>>>,
}

/// Segments whose leaves a [`NodeLog`] keeps (a segment of 1 M records: 32 MB).
const LEAF_CACHE_SEGMENTS: usize = 2;

impl std::fmt::Debug for NodeLog<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeLog")
            .field("node", &self.node)
            .field("digests", &self.digests.len())
            .finish()
    }
}

impl<'a> NodeLog<'a> {
    pub fn open(store: &'a dyn LogStore, node: u32) -> Result<Self, ProofError> {
        Ok(Self {
            store,
            node,
            digests: node_digests(store, node)?,
            leaves: std::sync::Mutex::new(BTreeMap::new()),
        })
    }

    /// The node's newest signed checkpoint note (with any cosignatures it holds).
    pub fn checkpoint_note(&self) -> Result<Vec<u8>, ProofError> {
        let rel = format!("{}/checkpoint", node_prefix(self.node));
        self.store.read(&rel).map_err(|_| ProofError::NoCheckpoint {
            node: self.node,
            path: self.store.locate(&rel).display().to_string(),
        })
    }

    /// The size of the tree the newest digest sealed at or before `wall_ns` signed (0: none
    /// was sealed by then).
    pub fn size_sealed_by(&self, wall_ns: i64) -> u64 {
        self.digests
            .iter()
            .filter(|d| d.sealed_wall_ns <= wall_ns)
            .filter_map(DigestBody::tree)
            .map(|t| t.size)
            .max()
            .unwrap_or(0)
    }

    /// The root a digest signed for a tree of `size` records.
    pub fn root_at(&self, size: u64) -> Result<Hash, ProofError> {
        self.digests
            .iter()
            .filter_map(DigestBody::tree)
            .find(|t| t.size == size)
            .map(|t| Hash(t.root))
            .ok_or(ProofError::UnsealedSize {
                node: self.node,
                size,
            })
    }

    /// The sealed record number `seq` in its canonical bytes (`crate::leaf`), or the lost
    /// placeholder if it never reached disk.
    pub fn record(&self, seq: u64) -> Result<Vec<u8>, ProofError> {
        let d = self
            .digests
            .iter()
            .find(|d| (d.seq_start..d.seq_end).contains(&seq))
            .ok_or_else(|| ProofError::Records {
                node: self.node,
                why: format!("seq {seq} is in no sealed digest"),
            })?;
        let batches = digest_batches(self.store, d).map_err(|why| ProofError::Records {
            node: self.node,
            why,
        })?;
        for (table, b) in &batches {
            let Some(seqs) = b
                .column(1)
                .as_any()
                .downcast_ref::<arrow::array::UInt64Array>()
            else {
                continue;
            };
            if let Some(row) = seqs.values().iter().position(|&s| s == seq) {
                let enc = leaf::RecordEncoder::new(*table, b).map_err(|e| ProofError::Records {
                    node: self.node,
                    why: e.to_string(),
                })?;
                let mut out = Vec::new();
                enc.encode(row, &mut out);
                return Ok(out);
            }
        }
        Ok(leaf::lost_record(self.node, seq))
    }

    /// The proof that record `index` is in the tree of `size` records.
    pub fn prove_inclusion(&self, index: u64, size: u64) -> Result<Vec<Hash>, ProofError> {
        let root = self.root_at(size)?;
        if index >= size {
            return Err(TlogError::PastTheTree {
                what: "record",
                asked: index,
                size,
            }
            .into());
        }
        let reader = tlog_tiles::TileHashReader::new(size, root, self);
        tlog_tiles::prove_record(size, index, &reader).map_err(|e| self.inconsistent(e))
    }

    /// The proof that the tree of `new` records extends the tree of `old` (both sealed).
    pub fn prove_consistency(&self, old: u64, new: u64) -> Result<Vec<Hash>, ProofError> {
        self.root_at(old)?;
        self.prove_extension(old, new)
    }

    /// [`NodeLog::prove_consistency`] from any size `old` (not only one a digest sealed): what
    /// holds another history's tree (a witness's) to this log's.
    fn prove_extension(&self, old: u64, new: u64) -> Result<Vec<Hash>, ProofError> {
        let root = self.root_at(new)?;
        if old == 0 || old > new {
            return Err(TlogError::BadSizes { old, new }.into());
        }
        let reader = tlog_tiles::TileHashReader::new(new, root, self);
        tlog_tiles::prove_tree(new, old, &reader).map_err(|e| self.inconsistent(e))
    }

    fn inconsistent(&self, e: tlog_tiles::Error) -> ProofError {
        ProofError::Inconsistent {
            node: self.node,
            why: e.to_string(),
        }
    }

    /// The hashes of level-0 tile `index`, `width` wide, from the sealed records.
    fn level0_from_records(&self, index: u64, width: u32) -> Result<Vec<u8>, tlog_tiles::Error> {
        let start = index << tlog::TILE_HEIGHT;
        let end = start + u64::from(width);
        let mut out = Vec::with_capacity(width as usize * tlog_tiles::HASH_SIZE);
        for d in self
            .digests
            .iter()
            .filter(|d| d.seq_start < end && d.seq_end > start)
        {
            let leaves = self.segment_leaves(d)?;
            let lo = start.max(d.seq_start) - d.seq_start;
            let hi = end.min(d.seq_end) - d.seq_start;
            for l in &leaves[lo as usize..hi as usize] {
                out.extend_from_slice(&l.0);
            }
        }
        if out.len() != width as usize * tlog_tiles::HASH_SIZE {
            return Err(tlog_tiles::Error::IndexesNotInTree);
        }
        Ok(out)
    }

    /// A sealed segment's leaves, recomputed from its records (cached).
    fn segment_leaves(
        &self,
        d: &DigestBody,
    ) -> Result<std::sync::Arc<Vec<Hash>>, tlog_tiles::Error> {
        let mut cache = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = cache.get(&d.digest_seq) {
            return Ok(l.clone());
        }
        let batches =
            digest_batches(self.store, d).map_err(|_| tlog_tiles::Error::IndexesNotInTree)?;
        let leaves = leaf::segment_leaves(
            self.node,
            d.seq_start,
            d.seq_end,
            batches.iter().map(|(t, b)| (*t, b)),
        )
        .map_err(|_| tlog_tiles::Error::IndexesNotInTree)?;
        if cache.len() >= LEAF_CACHE_SEGMENTS {
            cache.clear();
        }
        let leaves = std::sync::Arc::new(leaves);
        cache.insert(d.digest_seq, leaves.clone());
        Ok(leaves)
    }

    /// A tile's hashes: the full tile (cut to `width`), else the partial of exactly that width,
    /// else — level 0 — recomputed from the records.
    fn tile(&self, t: &tlog_tiles::Tile) -> Result<Vec<u8>, tlog_tiles::Error> {
        let prefix = node_prefix(self.node);
        let want = t.width() as usize * tlog_tiles::HASH_SIZE;
        let full = format!(
            "{prefix}/{}",
            tlog::tile_path(t.level(), t.level_index(), None)
        );
        if let Ok(b) = self.store.read(&full)
            && b.len() >= want
        {
            return Ok(b[..want].to_vec());
        }
        let partial = format!(
            "{prefix}/{}",
            tlog::tile_path(t.level(), t.level_index(), Some(t.width()))
        );
        if t.width() < 1 << tlog::TILE_HEIGHT
            && let Ok(b) = self.store.read(&partial)
        {
            return Ok(b);
        }
        if t.level() == 0 {
            return self.level0_from_records(t.level_index(), t.width());
        }
        Err(tlog_tiles::Error::IndexesNotInTree)
    }
}

impl tlog_tiles::TileReader for NodeLog<'_> {
    fn height(&self) -> u8 {
        tlog::TILE_HEIGHT
    }

    fn read_tiles(&self, tiles: &[tlog_tiles::Tile]) -> Result<Vec<Vec<u8>>, tlog_tiles::Error> {
        tiles.iter().map(|t| self.tile(t)).collect()
    }

    /// Nothing to save: the tiles are read from the log itself.
    fn save_tiles(&self, _tiles: &[tlog_tiles::Tile], _data: &[Vec<u8>]) {}
}

/// What one round of cosigning achieved.
#[derive(Debug, Default)]
pub struct CosignRound {
    /// The checkpoint's size.
    pub size: u64,
    /// The witnesses that cosigned it.
    pub cosigned_by: Vec<String>,
    /// The witnesses that did not, and why.
    pub failures: Vec<(String, String)>,
}

/// The newest checkpoint with the cosignatures collected so far: `_tlog/node=<n>/cosigned`.
pub fn cosigned_path(root: &Path, node: u32) -> PathBuf {
    root.join(node_prefix(node)).join("cosigned")
}

/// Sends the node's newest checkpoint to each witness (C2SP `add-checkpoint`: from the size it
/// last cosigned — `known[url]`, learnt from a 409 — with a consistency proof from the root
/// on disk), checks every cosignature returned, and writes the checkpoint with those it got to
/// [`cosigned_path`]. A witness that is down or refuses is a failure of this round; the node
/// goes on serving (its caller says so in the log).
pub fn cosign_newest(
    root: &Path,
    node: u32,
    witnesses: &[WitnessTarget],
    transport: &dyn WitnessTransport,
    known: &mut BTreeMap<String, u64>,
) -> Result<CosignRound, ProofError> {
    let store = LocalStore::new(root);
    let log = NodeLog::open(&store, node)?;
    let note = log.checkpoint_note()?;
    let size = tlog::note_checkpoint(&note)?.size();
    let mut round = CosignRound {
        size,
        ..CosignRound::default()
    };
    let mut lines = Vec::new();
    for w in witnesses {
        match ask_witness(&log, &note, size, w, transport, known) {
            Ok(l) => {
                lines.extend_from_slice(&l);
                round.cosigned_by.push(w.url.clone());
            }
            Err(why) => round.failures.push((w.url.clone(), why)),
        }
    }
    if !lines.is_empty() {
        let merged = crate::cosign::merge_signatures(&note, &lines)?;
        let path = cosigned_path(root, node);
        // Never replace a cosigned checkpoint with a smaller one.
        let older = fs::read(&path)
            .ok()
            .and_then(|b| tlog::note_checkpoint(&b).ok())
            .map(|c| c.size());
        if older.is_none_or(|s| s <= size) {
            write_durably(&path, &merged).map_err(|e| ProofError::Records {
                node,
                why: e.to_string(),
            })?;
        }
    }
    Ok(round)
}

/// Bound on `add-checkpoint` attempts per witness per round: the first, and one more from the
/// size a 409 names.
const ATTEMPTS: usize = 2;

/// One witness's cosignature line(s) for `note`, checked.
fn ask_witness(
    log: &NodeLog<'_>,
    note: &[u8],
    size: u64,
    w: &WitnessTarget,
    transport: &dyn WitnessTransport,
    known: &mut BTreeMap<String, u64>,
) -> Result<Vec<u8>, String> {
    let verifier = crate::cosign::CosignatureVerifier::new(&w.vkey).map_err(|e| e.to_string())?;
    let url = format!("{}/add-checkpoint", w.url.trim_end_matches('/'));
    for _ in 0..ATTEMPTS {
        let old = known.get(&w.url).copied().unwrap_or(0);
        if old > size {
            return Err(format!(
                "the witness cosigned {old} records, more than this node's {size}: this node's log was rolled back (restarted from an older disk?)"
            ));
        }
        let hashes = if old == 0 || old == size {
            Vec::new()
        } else {
            log.prove_consistency(old, size).map_err(|e| {
                format!("no consistency proof from the witness's {old} records: {e}")
            })?
        };
        let body = tlog::ConsistencyProof {
            old,
            hashes,
            checkpoint: note.to_vec(),
        }
        .to_bytes();
        let reply = transport.post(&url, &body).map_err(|e| e.to_string())?;
        match reply.status {
            200 => {
                let merged = crate::cosign::merge_signatures(note, &reply.body)
                    .map_err(|e| format!("a malformed reply: {e}"))?;
                let got = crate::cosign::cosignatures(&merged, std::slice::from_ref(&w.vkey))
                    .map_err(|e| e.to_string())?;
                if got.is_empty() {
                    return Err(format!(
                        "the reply holds no cosignature by {}",
                        signed_note::Verifier::name(&verifier)
                    ));
                }
                known.insert(w.url.clone(), size);
                return Ok(reply.body);
            }
            409 => {
                let theirs = String::from_utf8_lossy(&reply.body)
                    .trim()
                    .parse::<u64>()
                    .map_err(|_| "a 409 without the witness's size".to_owned())?;
                known.insert(w.url.clone(), theirs);
            }
            s => {
                return Err(format!(
                    "HTTP {s}: {}",
                    String::from_utf8_lossy(&reply.body).trim()
                ));
            }
        }
    }
    Err("the witness's size kept changing (409 twice)".into())
}

/// What `verify --witness` requires of a node's tree: a checkpoint cosigned by `min` of
/// these witness keys; and cosigned checkpoints obtained from the witnesses themselves
/// (`GET <witness>/<origin id>/checkpoint`), with where each came from, that the sealed
/// records must make.
#[derive(Clone, Debug, Default)]
pub struct WitnessPolicy {
    pub vkeys: Vec<String>,
    pub min: usize,
    pub checkpoints: Vec<(Vec<u8>, String)>,
}

/// The node's own cosigned checkpoint (`_tlog/node=<n>/cosigned`) and every checkpoint of it in
/// `policy.checkpoints`, each held to the policy and to the sealed tree (`roots`: every size a
/// digest sealed, with its root). Returns the largest size they vouch for.
pub fn check_cosigned(
    store: &dyn LogStore,
    node: u32,
    key: &VerifyingKey,
    roots: &BTreeMap<u64, Hash>,
    policy: &WitnessPolicy,
    problems: &mut Vec<Problem>,
) -> Option<u64> {
    let rel = format!("{}/cosigned", node_prefix(node));
    let Ok(own) = store.read(&rel) else {
        problems.push(Problem::NotWitnessed {
            node,
            why: format!("no cosigned checkpoint ({})", store.locate(&rel).display()),
        });
        return None;
    };
    let origin = origin_line(&own);
    let log = SealedLog {
        store,
        node,
        key,
        roots,
    };
    let place = store.locate(&rel).display().to_string();
    let mut best = hold_cosigned(&log, &own, &place, policy, problems);
    for (note, place) in &policy.checkpoints {
        if origin_line(note) != origin {
            continue;
        }
        let got = hold_cosigned(&log, note, place, policy, problems);
        best = best.max(got);
    }
    best
}

/// A node's sealed log as `verify` rebuilt it: what a cosigned checkpoint is held to.
struct SealedLog<'a> {
    store: &'a dyn LogStore,
    node: u32,
    key: &'a VerifyingKey,
    /// Every size a digest sealed, with the root the records make.
    roots: &'a BTreeMap<u64, Hash>,
}

/// Whether the node's sealed tree of `new` records (root in `roots`) extends a tree of `old`
/// records with root `old_root`: a consistency proof from the log's tiles and records, checked.
fn extends(
    store: &dyn LogStore,
    node: u32,
    old: u64,
    old_root: Hash,
    new: u64,
    roots: &BTreeMap<u64, Hash>,
) -> Result<bool, ProofError> {
    let new_root = *roots
        .get(&new)
        .ok_or(ProofError::UnsealedSize { node, size: new })?;
    let proof = NodeLog::open(store, node)?.prove_extension(old, new)?;
    Ok(tlog::verify_consistency(&proof, new, new_root, old, old_root).is_ok())
}

fn origin_line(note: &[u8]) -> String {
    note.split(|&b| b == b'\n')
        .next()
        .and_then(|l| std::str::from_utf8(l).ok())
        .unwrap_or_default()
        .to_owned()
}

/// One cosigned checkpoint: the node's signature, the quorum, and the sealed tree's root at its
/// size (a larger size than the log has: a cut or rolled-back log).
fn hold_cosigned(
    log: &SealedLog<'_>,
    note: &[u8],
    place: &str,
    policy: &WitnessPolicy,
    problems: &mut Vec<Problem>,
) -> Option<u64> {
    let SealedLog {
        store,
        node,
        key,
        roots,
    } = *log;
    let fail = |why: String| Problem::NotWitnessed {
        node,
        why: format!("{place}: {why}"),
    };
    let cp = match tlog::open_checkpoint(note, &tlog::ed25519_vkey(&origin_line(note), key)) {
        Ok(cp) => cp,
        Err(e) => {
            problems.push(fail(format!("not signed by the node's key: {e}")));
            return None;
        }
    };
    let got = match crate::cosign::cosignatures(note, &policy.vkeys) {
        Ok(g) => g,
        Err(e) => {
            problems.push(fail(e.to_string()));
            return None;
        }
    };
    if got.len() < policy.min {
        problems.push(fail(format!(
            "{} of the required {} witnesses cosigned it ({} records)",
            got.len(),
            policy.min,
            cp.size()
        )));
        return None;
    }
    let largest = roots.keys().next_back().copied().unwrap_or(0);
    let why = match roots.get(&cp.size()) {
        Some(r) if r == cp.hash() => return Some(cp.size()),
        Some(_) => format!(
            "the witnesses cosigned another tree of {} records than the sealed records make (a forked history)",
            cp.size()
        ),
        None if cp.size() > largest => format!(
            "the witnesses cosigned {} records; the log holds {largest} (its tail was cut, or the node rolled back)",
            cp.size()
        ),
        // Between two seals of this log (another history's seal): does this log's tree extend
        // the one the witnesses cosigned?
        None => match extends(store, node, cp.size(), *cp.hash(), largest, roots) {
            Ok(true) => return Some(cp.size()),
            Ok(false) => format!(
                "the witnesses cosigned a tree of {} records that the sealed records' tree does not extend (a forked history)",
                cp.size()
            ),
            Err(e) => format!(
                "the witnesses cosigned {} records, a size no digest sealed, and no consistency proof could be made: {e}",
                cp.size()
            ),
        },
    };
    problems.push(Problem::TreeCheckpointInvalid {
        node,
        why: format!("{place}: {why}"),
    });
    None
}

/// What a request's receipt is, for now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiptStatus {
    /// Every record of the request is sealed and in the checkpoint: the receipt (JSON,
    /// `custody-receipt/1`).
    Ready(Vec<u8>),
    /// Some of its records are not sealed, or not yet in a signed checkpoint: ask again after
    /// the next seal.
    Pending,
    /// No such request of this tenant in this incarnation of the node's log.
    Unknown,
}

/// The receipt format's name.
pub const RECEIPT_FORMAT: &str = "custody-receipt/1";

/// Bound on the records one receipt proves (a request's page events and reads are a few per
/// page it touched; past this the receipt is refused rather than built without limit).
pub const MAX_RECEIPT_RECORDS: usize = 100_000;

/// Request `request`'s receipt for `tenant` on node `node`, whose current incarnation's records
/// start at `from_seq` (request ids restart with the node): every record of the request (any
/// table with a `request_id` column), each with its inclusion proof (C2SP `tlog-proof@v1`, the
/// record's bytes as `extra`) to the node's newest checkpoint — the cosigned one if its
/// witnesses cosigned it. A record of the request that names another tenant makes it Unknown
/// (a receipt reveals only the asker's own records).
pub fn request_receipt(
    store: &dyn LogStore,
    node: u32,
    from_seq: u64,
    tenant: &str,
    request: u64,
) -> Result<ReceiptStatus, ProofError> {
    request_receipt_within(store, node, from_seq, None, tenant, request)
}

/// [`request_receipt`] reading only the segments of `span` (the request's first and last
/// record, from the writer's [`crate::request_index::RequestSpans`]) when it is known.
pub fn request_receipt_within(
    store: &dyn LogStore,
    node: u32,
    from_seq: u64,
    span: Option<crate::request_index::Span>,
    tenant: &str,
    request: u64,
) -> Result<ReceiptStatus, ProofError> {
    receipt_from(
        &NodeLog::open(store, node)?,
        from_seq,
        span,
        tenant,
        request,
    )
}

/// [`request_receipt_within`] over a node's log already open: one [`NodeLog`] serving many
/// receipts keeps the leaves it recomputed (a notice's receipts share segments).
pub fn receipt_from(
    log: &NodeLog<'_>,
    from_seq: u64,
    span: Option<crate::request_index::Span>,
    tenant: &str,
    request: u64,
) -> Result<ReceiptStatus, ProofError> {
    let (store, node) = (log.store, log.node);
    // (No shortcut to Pending on the span alone: another tenant's request must look unknown.)
    let (lo, hi) = span.map_or((from_seq, u64::MAX), |s| (s.first, s.last));
    let mut found: Vec<(Table, u64, Vec<u8>)> = Vec::new();
    let mut ended = false;
    let mut admitted_seen = false;
    // Newest first: a request's records all follow its admission, so the scan stops at the
    // segment that holds it (a receipt costs what has been sealed since the request, not the
    // whole log); with its span, only the segments it spans are read.
    for d in log
        .digests
        .iter()
        .rev()
        .filter(|d| d.seq_end > lo && d.seq_start <= hi)
    {
        if found.iter().any(|(t, _, _)| *t == Table::Requests) && admitted_seen {
            break;
        }
        let batches = digest_batches(store, d).map_err(|why| ProofError::Records { node, why })?;
        for (table, b) in &batches {
            let rows = request_rows(b, from_seq, request);
            if rows.is_empty() {
                continue;
            }
            let enc = leaf::RecordEncoder::new(*table, b).map_err(|e| ProofError::Records {
                node,
                why: e.to_string(),
            })?;
            for (row, seq) in rows {
                if column_str(b, "tenant", row).is_some_and(|t| t != tenant) {
                    return Ok(ReceiptStatus::Unknown);
                }
                if *table == Table::Requests {
                    match column_str(b, "event", row) {
                        Some("admitted") => admitted_seen = true,
                        Some(_) => ended = true,
                        None => {}
                    }
                }
                let mut bytes = Vec::new();
                enc.encode(row, &mut bytes);
                found.push((*table, seq, bytes));
                if found.len() > MAX_RECEIPT_RECORDS {
                    return Err(ProofError::Records {
                        node,
                        why: format!(
                            "request {request} has more than {MAX_RECEIPT_RECORDS} records"
                        ),
                    });
                }
            }
        }
    }
    let admitted_here = found.iter().any(|(t, _, _)| *t == Table::Requests);
    if !admitted_here {
        // Not sealed yet, or no such request of this tenant: the live segment tells.
        return Ok(match live_rows(store, node, from_seq, request) {
            LiveRows::Tenant(t) if t == tenant => ReceiptStatus::Pending,
            _ => ReceiptStatus::Unknown,
        });
    }
    let max_seq = found.iter().map(|(_, seq, _)| *seq).max().unwrap_or(0);
    let note = match log.cosigned_or_newest(max_seq) {
        Ok(n) => n,
        Err(ProofError::NoCheckpoint { .. }) => return Ok(ReceiptStatus::Pending),
        Err(e) => return Err(e),
    };
    let cp = tlog::note_checkpoint(&note)?;
    let size = cp.size();
    if !ended || found.iter().any(|(_, seq, _)| *seq >= size) {
        return Ok(ReceiptStatus::Pending);
    }
    found.sort_by_key(|(_, seq, _)| *seq);
    let mut records = Vec::with_capacity(found.len());
    for (table, seq, bytes) in found {
        let proof = tlog::InclusionProof {
            extra: Some(bytes),
            index: seq,
            hashes: log.prove_inclusion(seq, size)?,
            checkpoint: note.clone(),
        };
        records.push(serde_json::json!({
            "table": table.name(),
            "seq": seq,
            "proof": String::from_utf8_lossy(&proof.to_bytes()),
        }));
    }
    let receipt = serde_json::json!({
        "format": RECEIPT_FORMAT,
        "node": node,
        "request_id": format!("req-{node}-{request}"),
        "tenant": tenant,
        "origin": cp.origin(),
        "tree_size": size,
        "checkpoint": String::from_utf8_lossy(&note),
        "records": records,
    });
    Ok(ReceiptStatus::Ready(
        serde_json::to_vec_pretty(&receipt).unwrap_or_default(),
    ))
}

/// What the live segment holds of a request.
enum LiveRows {
    None,
    /// Rows of the request, of this tenant.
    Tenant(String),
}

/// Whether the live (unsealed) segment holds rows of `request` (this incarnation), and whose.
/// Reads every complete message of the live files (a torn last one is the writer's next).
fn live_rows(store: &dyn LogStore, node: u32, from_seq: u64, request: u64) -> LiveRows {
    let Ok(files) = store.list(&format!("_live/node={node}/")) else {
        return LiveRows::None;
    };
    for f in files.iter().filter(|f| f.ends_with(".arrows")) {
        let Ok(bytes) = store.read(f) else { continue };
        let Ok(reader) =
            arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)
        else {
            continue;
        };
        for b in reader.map_while(Result::ok) {
            if let Some(&(row, _)) = request_rows(&b, from_seq, request).first()
                && let Some(t) = column_str(&b, "tenant", row)
            {
                return LiveRows::Tenant(t.to_owned());
            }
        }
    }
    LiveRows::None
}

/// The rows of `b` with `request_id == request` and `seq >= from_seq`, with their seqs.
fn request_rows(b: &RecordBatch, from_seq: u64, request: u64) -> Vec<(usize, u64)> {
    use arrow::array::{Array, UInt64Array};
    let (Some(ids), Some(seqs)) = (
        b.column_by_name("request_id")
            .and_then(|c| c.as_any().downcast_ref::<UInt64Array>()),
        b.column_by_name("seq")
            .and_then(|c| c.as_any().downcast_ref::<UInt64Array>()),
    ) else {
        return Vec::new();
    };
    (0..b.num_rows())
        .filter(|&i| ids.is_valid(i) && ids.value(i) == request && seqs.value(i) >= from_seq)
        .map(|i| (i, seqs.value(i)))
        .collect()
}

fn column_str<'a>(b: &'a RecordBatch, name: &str, row: usize) -> Option<&'a str> {
    use arrow::array::{Array, StringArray};
    let c = b
        .column_by_name(name)?
        .as_any()
        .downcast_ref::<StringArray>()?;
    c.is_valid(row).then(|| c.value(row))
}

impl NodeLog<'_> {
    /// The checkpoint proofs of records up to `max_seq` go to: the cosigned one
    /// (`_tlog/node=<n>/cosigned`) if it covers them and is a tree a digest sealed, else the
    /// newest the node signed.
    pub fn cosigned_or_newest(&self, max_seq: u64) -> Result<Vec<u8>, ProofError> {
        let rel = format!("{}/cosigned", node_prefix(self.node));
        if let Ok(c) = self.store.read(&rel)
            && let Ok(cp) = tlog::note_checkpoint(&c)
            && cp.size() > max_seq
            && self.root_at(cp.size()).is_ok_and(|r| r == *cp.hash())
        {
            return Ok(c);
        }
        self.checkpoint_note()
    }
}

/// A receipt that checked: its request, checkpoint, cosigners and records.
#[derive(Debug, Clone)]
pub struct CheckedReceipt {
    pub request_id: String,
    pub tenant: String,
    pub origin: String,
    pub tree_size: u64,
    pub cosigned_by: Vec<crate::cosign::Cosigned>,
    /// Each record: its table, seq, and decoded columns.
    pub records: Vec<(u64, crate::leaf::DecodedRecord)>,
    /// Each record's leaf hash, by seq (what a receipt promise names).
    pub leaves: std::collections::BTreeMap<u64, Hash>,
}

/// Why a receipt does not check.
#[derive(Debug, thiserror::Error)]
pub enum ReceiptError {
    #[error("not a {RECEIPT_FORMAT} receipt: {0}")]
    Malformed(String),
    #[error("record {seq}: {source}")]
    Proof { seq: u64, source: TlogError },
    #[error("{0}")]
    Policy(String),
    #[error("the receipt promise: {0}")]
    Promise(#[from] crate::promise::PromiseError),
    #[error(
        "the node promised record {seq} ({table}) of {request_id} in its response, but {why}: \
         its log lost or rewrote the record (keep the signed promise and this receipt: together \
         they are evidence)"
    )]
    PromiseBroken {
        request_id: String,
        seq: u64,
        table: String,
        why: &'static str,
    },
}

/// Checks a receipt offline: every record's inclusion proof against the node's key (under the
/// receipt's origin), all to the one checkpoint the receipt names, every record decoding as a
/// canonical record of the receipt's tenant and request, and — with `witnesses` — that many
/// cosignatures on the checkpoint.
pub fn verify_receipt(
    json: &[u8],
    node_key: &VerifyingKey,
    witnesses: Option<&WitnessPolicy>,
) -> Result<CheckedReceipt, ReceiptError> {
    let bad = |m: &str| ReceiptError::Malformed(m.to_owned());
    let v: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| ReceiptError::Malformed(e.to_string()))?;
    if v["format"] != RECEIPT_FORMAT {
        return Err(bad("format"));
    }
    let s = |k: &str| v[k].as_str().map(str::to_owned).ok_or_else(|| bad(k));
    let (request_id, tenant, origin, checkpoint) = (
        s("request_id")?,
        s("tenant")?,
        s("origin")?,
        s("checkpoint")?,
    );
    let request: u64 = request_id
        .rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| bad("request_id"))?;
    let vkey = tlog::ed25519_vkey(&origin, node_key);
    let cp = tlog::open_checkpoint(checkpoint.as_bytes(), &vkey)
        .map_err(|e| ReceiptError::Proof { seq: 0, source: e })?;
    if cp.origin() != origin {
        return Err(bad("origin is not the checkpoint's"));
    }
    let cosigned_by = match witnesses {
        Some(p) => {
            let got = crate::cosign::cosignatures(checkpoint.as_bytes(), &p.vkeys)
                .map_err(|e| ReceiptError::Policy(e.to_string()))?;
            if got.len() < p.min {
                return Err(ReceiptError::Policy(format!(
                    "{} of the required {} witnesses cosigned its checkpoint",
                    got.len(),
                    p.min
                )));
            }
            got
        }
        None => Vec::new(),
    };
    let mut records = Vec::new();
    let mut leaves = std::collections::BTreeMap::new();
    for r in v["records"].as_array().ok_or_else(|| bad("records"))? {
        let text = r["proof"].as_str().ok_or_else(|| bad("records[].proof"))?;
        let p = tlog::InclusionProof::parse(text.as_bytes())
            .map_err(|e| ReceiptError::Malformed(e.to_string()))?;
        let seq = p.index;
        if p.checkpoint != checkpoint.as_bytes() {
            return Err(bad("a record's proof is to another checkpoint"));
        }
        p.verify(&vkey)
            .map_err(|source| ReceiptError::Proof { seq, source })?;
        let rec = leaf::decode_record(p.extra.as_deref().unwrap_or_default())
            .map_err(|e| ReceiptError::Malformed(format!("record {seq}: {e}")))?;
        let col = |n: &str| {
            rec.columns
                .iter()
                .find(|(c, _)| c == n)
                .and_then(|(_, v)| v.clone())
        };
        if col("seq") != Some(leaf::Value::U64(seq))
            || col("request_id") != Some(leaf::Value::U64(request))
            || col("tenant") != Some(leaf::Value::Utf8(tenant.clone()))
        {
            return Err(bad(&format!(
                "record {seq} is not a record of {request_id} of tenant {tenant}"
            )));
        }
        leaves.insert(seq, record_hash(p.extra.as_deref().unwrap_or_default()));
        records.push((seq, rec));
    }
    if records.is_empty() {
        return Err(bad("no records"));
    }
    Ok(CheckedReceipt {
        request_id,
        tenant,
        origin,
        tree_size: cp.size(),
        cosigned_by,
        records,
        leaves,
    })
}

/// What a receipt promise checked against a verified receipt says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromiseKept {
    /// Records the promise named: each in the receipt with the promised leaf hash.
    pub promised: usize,
    /// Records in the receipt the promise did not name (written after the answer).
    pub unpromised: Vec<u64>,
}

/// Checks the signed promise a node gave in its answer (`custody_receipt.requests[].promise`)
/// against a receipt [`verify_receipt`] accepted: signed by the same node key under the same
/// origin, for the same request and tenant, and every promised record in the receipt with the
/// promised leaf hash — a record missing or changed is [`ReceiptError::PromiseBroken`].
pub fn check_promise(
    receipt: &CheckedReceipt,
    promise_note: &[u8],
    node_key: &VerifyingKey,
) -> Result<PromiseKept, ReceiptError> {
    let vkey = tlog::ed25519_vkey(&receipt.origin, node_key);
    let p = crate::promise::Promise::open(promise_note, &vkey)?;
    let bad = |m: &str| ReceiptError::Malformed(format!("the promise: {m}"));
    if p.origin != receipt.origin {
        return Err(bad("another origin's"));
    }
    if p.request_id != receipt.request_id || p.tenant != receipt.tenant {
        return Err(bad(&format!(
            "it is of {} of tenant {}, the receipt of {} of tenant {}",
            p.request_id, p.tenant, receipt.request_id, receipt.tenant
        )));
    }
    for l in &p.leaves {
        let why = match receipt.leaves.get(&l.seq) {
            Some(h) if *h == l.leaf => continue,
            Some(_) => "the receipt's record at that seq is another",
            None => "the receipt has no record at that seq",
        };
        return Err(ReceiptError::PromiseBroken {
            request_id: p.request_id.clone(),
            seq: l.seq,
            table: l.table.clone(),
            why,
        });
    }
    let unpromised = receipt
        .leaves
        .keys()
        .filter(|s| !p.leaves.iter().any(|l| l.seq == **s))
        .copied()
        .collect();
    Ok(PromiseKept {
        promised: p.leaves.len(),
        unpromised,
    })
}

/// What a node's own log says of a promise it signed (`check_promise_in_log`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromiseInLog {
    /// The checkpoint it was held to: the cosigned one when it covers the promise.
    pub tree_size: u64,
    /// Promised records the tree holds, at their seq, with the promised leaf (proved).
    pub kept: Vec<u64>,
    /// Promised records whose seq holds another leaf in that tree: the log broke the promise.
    pub broken: Vec<u64>,
    /// Promised records past that tree (not sealed yet).
    pub pending: Vec<u64>,
}

/// Holds a promise the node signed (`promise_note`) to the node's log under `store`: for each
/// promised record, an inclusion proof of the promised leaf at its seq against the node's
/// (cosigned) checkpoint, signed by `node_key`. A leaf that does not prove is a broken promise —
/// the record the tenant was promised is not in this log (a fork, a rewrite, a rollback).
pub fn check_promise_in_log(
    store: &dyn LogStore,
    node: u32,
    promise_note: &[u8],
    node_key: &VerifyingKey,
) -> Result<(crate::promise::Promise, PromiseInLog), ReceiptError> {
    let log = NodeLog::open(store, node).map_err(|e| ReceiptError::Malformed(e.to_string()))?;
    let origin = crate::promise::Promise::of_note(promise_note)?.origin;
    let vkey = tlog::ed25519_vkey(&origin, node_key);
    let promise = crate::promise::Promise::open(promise_note, &vkey)?;
    let max_seq = promise.leaves.iter().map(|l| l.seq).max().unwrap_or(0);
    let note = log
        .cosigned_or_newest(max_seq)
        .map_err(|e| ReceiptError::Malformed(e.to_string()))?;
    let cp = tlog::open_checkpoint(&note, &vkey)
        .map_err(|e| ReceiptError::Proof { seq: 0, source: e })?;
    if cp.origin() != origin {
        return Err(ReceiptError::Malformed(format!(
            "the promise is of {origin}, this log is {}",
            cp.origin()
        )));
    }
    let size = cp.size();
    let mut found = PromiseInLog {
        tree_size: size,
        kept: Vec::new(),
        broken: Vec::new(),
        pending: Vec::new(),
    };
    for l in &promise.leaves {
        if l.seq >= size {
            found.pending.push(l.seq);
            continue;
        }
        let hashes = log
            .prove_inclusion(l.seq, size)
            .map_err(|e| ReceiptError::Malformed(e.to_string()))?;
        let proof: tlog_tiles::RecordProof = hashes;
        match tlog::verify_inclusion(&proof, size, *cp.hash(), l.seq, l.leaf) {
            Ok(()) => found.kept.push(l.seq),
            Err(_) => found.broken.push(l.seq),
        }
    }
    Ok((promise, found))
}

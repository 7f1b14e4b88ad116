//! The Merkle tree over a node's audit records (issue 40, first step): RFC 6962 hashing
//! (leaf = SHA-256(0x00‖record), node = SHA-256(0x01‖left‖right)), inclusion and consistency
//! proofs, and the C2SP `tlog-tiles` layout of its hashes — through `tlog_tiles` (Cloudflare's
//! port of Go's `sumdb/tlog`, the code behind its CT log), not hand-written proofs.
//!
//! `tlog_tiles` stores every hash of the tree once, by a *stored hash index* (each record's
//! leaf hash followed by the hashes of the complete subtrees it closes): [`Tree`] keeps them in
//! memory, in that order, and answers the crate's `HashReader`. Its own tile paths are Go's
//! (`tile/8/0/x001/...`, `tile/8/data/...`), not C2SP's: [`tile_path`] writes C2SP's.
//!
//! Checkpoints are C2SP `tlog-checkpoint` texts (origin, size, root) in C2SP `signed-note`s
//! (`signed_note`, the same port's), signed by [`NoteSigner`]: the node's Ed25519 key.
//!
//! Checked against the RFC 6962 vectors of transparency-dev/merkle (`testonly/constants.go`,
//! `proof/verify_test.go`), the tile counts of the C2SP `tlog-tiles` spec and Go's
//! `sumdb/note` signature example (the `PeterNeumann` key).

use tlog_tiles::{
    HashReader, RecordProof, Tile, TreeProof, check_record, check_tree, node_hash, prove_record,
    prove_tree, record_hash, stored_hash_count, stored_hash_index, stored_hashes_for_record_hash,
    tree_hash,
};

/// A C2SP `tlog-checkpoint` (origin, size, root).
pub use tlog_tiles::Checkpoint;
/// A SHA-256 hash of the tree (a leaf, a node, a root).
pub use tlog_tiles::Hash;

/// Whether `name` can name a signed-note key (non-empty, no spaces, no `+`).
pub fn is_key_name(name: &str) -> bool {
    signed_note::is_key_name_valid(name)
}

/// The C2SP verifier key of an Ed25519 key under `name`: `<name>+<key id>+<base64(0x01‖key)>`.
pub fn ed25519_vkey(name: &str, key: &ed25519_dalek::VerifyingKey) -> String {
    signed_note::new_ed25519_verifier_key(name, key)
}

/// Hashes per full tile: C2SP `tlog-tiles` tiles are 8 levels high (256 hashes wide).
pub const TILE_HEIGHT: u8 = 8;

#[derive(Debug, thiserror::Error)]
pub enum TlogError {
    #[error("the tree has {size} records; {what} {asked} is past it")]
    PastTheTree {
        what: &'static str,
        asked: u64,
        size: u64,
    },
    #[error("a proof between sizes {old} and {new}: the old size must be 1..=new")]
    BadSizes { old: u64, new: u64 },
    #[error("the proof does not check: {0}")]
    Invalid(tlog_tiles::Error),
    #[error("the Merkle tree: {0}")]
    Tree(tlog_tiles::Error),
    #[error("not a C2SP tile path: {0:?}")]
    BadTilePath(String),
    #[error("{0:?} is not a signed-note key name (non-empty, no spaces, no '+')")]
    BadKeyName(String),
    #[error("not a C2SP checkpoint")]
    MalformedCheckpoint,
    #[error("the signed note: {0}")]
    Note(#[from] signed_note::NoteError),
    #[error("the partial tiles do not make a tree of {size} records (tile level {level})")]
    EdgeMismatch { level: u8, size: u64 },
    #[error("not a cosignature (0x04) verifier key: {0:?}")]
    BadVerifierKey(String),
    #[error("the cosignature of witness {0} does not check (the note or the line was altered)")]
    BadCosignature(String),
    #[error("a malformed proof: {0}")]
    MalformedProof(&'static str),
    #[error("the verifier key: {0}")]
    VerifierKey(#[from] signed_note::VerifierError),
}

/// A Merkle tree of records, all its stored hashes in memory (32 bytes per record and per
/// complete subtree: under 64 bytes per record in all).
#[derive(Debug, Default, Clone)]
pub struct Tree {
    /// By stored hash index.
    stored: Vec<Hash>,
    size: u64,
}

impl HashReader for Tree {
    fn read_hashes(&self, indexes: &[u64]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        indexes
            .iter()
            .map(|&i| {
                usize::try_from(i)
                    .ok()
                    .and_then(|i| self.stored.get(i).copied())
                    .ok_or(tlog_tiles::Error::IndexesNotInTree)
            })
            .collect()
    }
}

impl Tree {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records in the tree.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Appends one record (its leaf hash is SHA-256(0x00‖record)); returns its index.
    pub fn append(&mut self, record: &[u8]) -> Result<u64, TlogError> {
        self.append_leaf(record_hash(record))
    }

    /// Appends a leaf hash computed elsewhere; returns its index.
    pub fn append_leaf(&mut self, leaf: Hash) -> Result<u64, TlogError> {
        let n = self.size;
        let new = stored_hashes_for_record_hash(n, leaf, self).map_err(TlogError::Tree)?;
        self.stored.extend(new);
        self.size += 1;
        debug_assert_eq!(self.stored.len() as u64, stored_hash_count(self.size));
        Ok(n)
    }

    /// The root hash of the tree's first `size` records (RFC 6962's MTH; the empty tree's is
    /// SHA-256 of nothing).
    pub fn root(&self, size: u64) -> Result<Hash, TlogError> {
        self.within("size", size)?;
        tree_hash(size, self).map_err(TlogError::Tree)
    }

    /// The proof that record `index` is in the tree of the first `size` records.
    pub fn prove_inclusion(&self, index: u64, size: u64) -> Result<RecordProof, TlogError> {
        self.within("size", size)?;
        if index >= size {
            return Err(TlogError::PastTheTree {
                what: "record",
                asked: index,
                size,
            });
        }
        prove_record(size, index, self).map_err(TlogError::Tree)
    }

    /// The proof that the tree of the first `new` records extends the one of the first `old`.
    pub fn prove_consistency(&self, old: u64, new: u64) -> Result<TreeProof, TlogError> {
        self.within("size", new)?;
        if old == 0 || old > new {
            return Err(TlogError::BadSizes { old, new });
        }
        prove_tree(new, old, self).map_err(TlogError::Tree)
    }

    /// The tiles a tree grown from `old` to `new` records adds or widens, with their bytes
    /// (C2SP: each full tile 256 hashes, a partial one as wide as it is), hash tiles only.
    pub fn tiles(&self, old: u64, new: u64) -> Result<Vec<TileFile>, TlogError> {
        self.within("size", new)?;
        if old > new {
            return Err(TlogError::BadSizes { old, new });
        }
        Tile::new_tiles(TILE_HEIGHT, old, new)
            .into_iter()
            .map(|t| {
                let bytes = t.read_data(self).map_err(TlogError::Tree)?;
                let full = t.width() == 1 << TILE_HEIGHT;
                Ok(TileFile {
                    path: tile_path(t.level(), t.level_index(), (!full).then_some(t.width())),
                    bytes,
                })
            })
            .collect()
    }

    fn within(&self, what: &'static str, size: u64) -> Result<(), TlogError> {
        if size > self.size {
            return Err(TlogError::PastTheTree {
                what,
                asked: size,
                size: self.size,
            });
        }
        Ok(())
    }
}

/// The right edge of a tree: the partial tile at each tile level (fewer than 256 hashes each)
/// and the roots of the complete subtrees the size is made of (its binary digits) — O(log n)
/// memory, however large the tree. Tiles that fill up are handed out
/// ([`EdgeTree::take_full_tiles`]) for the writer to store or the verifier to compare.
///
/// Appending merges subtree roots as a binary counter carries (RFC 6962's hashing, through
/// `tlog_tiles`' `node_hash`): one node hash per record, amortised. `tlog_tiles`' own append
/// (`stored_hashes_for_record_hash`) reads each left sibling back through a `HashReader`, which
/// from tiles means re-hashing up to 128 hashes of a tile per level: measured 0.9 µs per record
/// against the writer's 0.4 µs per event budget. Its result is the same hashes (tested against
/// [`Tree`], which uses it); `tlog_tiles` still rebuilds the subtree roots of an edge read back
/// from disk ([`EdgeTree::from_partials`]).
#[derive(Debug, Default, Clone)]
pub struct EdgeTree {
    size: u64,
    /// `edge[l]`: the hashes (32 bytes each) of the partial tile at tile level `l`.
    edge: Vec<Vec<u8>>,
    /// The roots of the complete subtrees of the tree, left to right, with their levels
    /// (strictly decreasing: the set bits of `size`).
    subtrees: Vec<(u8, Hash)>,
    /// Tiles filled since the last [`EdgeTree::take_full_tiles`], in the order they filled.
    full: Vec<TileFile>,
}

/// Bytes of a full tile.
const FULL_TILE_BYTES: usize = (1 << TILE_HEIGHT) * tlog_tiles::HASH_SIZE;

impl EdgeTree {
    pub fn new() -> Self {
        Self::default()
    }

    /// A tree of `size` records from its partial tiles (`partials[l]`: the hashes of the
    /// partial tile at level `l`; its width must be `size`'s digit at that level in base 256).
    pub fn from_partials(size: u64, partials: Vec<Vec<u8>>) -> Result<Self, TlogError> {
        for (level, data) in partials.iter().enumerate() {
            let want = Self::partial_width(size, level as u8) as usize * tlog_tiles::HASH_SIZE;
            if data.len() != want {
                return Err(TlogError::EdgeMismatch {
                    level: level as u8,
                    size,
                });
            }
        }
        if Self::levels(size) > partials.len() {
            return Err(TlogError::EdgeMismatch {
                level: partials.len() as u8,
                size,
            });
        }
        let mut tree = Self {
            size,
            edge: partials,
            subtrees: Vec::new(),
            full: Vec::new(),
        };
        // Each complete subtree's root from the tile that holds it.
        for level in (0..64u8).rev().filter(|l| size >> l & 1 == 1) {
            let index = stored_hash_index(level, (size >> level) - 1);
            let hash = tree.read_hashes(&[index]).map_err(TlogError::Tree)?[0];
            tree.subtrees.push((level, hash));
        }
        Ok(tree)
    }

    /// Tile levels a tree of `size` records has hashes at.
    pub fn levels(size: u64) -> usize {
        let mut n = 0;
        let mut s = size;
        while s > 0 {
            n += 1;
            s >>= TILE_HEIGHT;
        }
        n
    }

    /// Width of the partial tile at `level` of a tree of `size` records (0: none).
    pub fn partial_width(size: u64, level: u8) -> u32 {
        let shift = u32::from(level) * u32::from(TILE_HEIGHT);
        if shift >= 64 {
            return 0;
        }
        ((size >> shift) & ((1 << TILE_HEIGHT) - 1)) as u32
    }

    /// Records in the tree.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Appends one leaf hash; returns its index.
    pub fn append_leaf(&mut self, leaf: Hash) -> Result<u64, TlogError> {
        let n = self.size;
        let (mut level, mut hash) = (0u8, leaf);
        loop {
            self.store(level, hash, n);
            match self.subtrees.last() {
                Some(&(l, left)) if l == level => {
                    self.subtrees.pop();
                    hash = node_hash(left, hash);
                    level += 1;
                }
                _ => break,
            }
        }
        self.subtrees.push((level, hash));
        self.size += 1;
        debug_assert_eq!(
            self.subtrees.len() as u32,
            self.size.count_ones(),
            "one subtree per set bit of the size"
        );
        Ok(n)
    }

    /// Keeps a new hash of `level` (made by appending record `n`) if a tile stores that level.
    fn store(&mut self, level: u8, hash: Hash, n: u64) {
        if !level.is_multiple_of(TILE_HEIGHT) {
            return;
        }
        let tl = usize::from(level / TILE_HEIGHT);
        if self.edge.len() <= tl {
            self.edge.resize(tl + 1, Vec::new());
        }
        self.edge[tl].extend_from_slice(&hash.0);
        if self.edge[tl].len() == FULL_TILE_BYTES {
            // The hash is number `(n + 1) >> level) - 1` of its level, `n + 1` a multiple of
            // 2^level; its tile is that number over 256.
            let index = ((n + 1) >> level).saturating_sub(1) >> TILE_HEIGHT;
            self.full.push(TileFile {
                path: tile_path(tl as u8, index, None),
                bytes: std::mem::take(&mut self.edge[tl]),
            });
        }
    }

    /// The root hash of the whole tree (RFC 6962's MTH; SHA-256 of nothing when empty).
    pub fn root(&self) -> Result<Hash, TlogError> {
        let mut it = self.subtrees.iter().rev();
        let Some(&(_, mut root)) = it.next() else {
            return tree_hash(0, self).map_err(TlogError::Tree);
        };
        for &(_, left) in it {
            root = node_hash(left, root);
        }
        Ok(root)
    }

    /// The tiles that filled up since the last call (C2SP paths, 8,192 bytes each).
    pub fn take_full_tiles(&mut self) -> Vec<TileFile> {
        std::mem::take(&mut self.full)
    }

    /// The partial tiles of the tree as it stands that a tree of `since` records did not have
    /// (at a level whose hashes grew since): `since = 0` gives them all.
    pub fn partial_tiles(&self, since: u64) -> Vec<TileFile> {
        let grew = |l: usize| {
            let shift = l as u32 * u32::from(TILE_HEIGHT);
            shift >= 64 || since == 0 || (since >> shift) != (self.size >> shift)
        };
        self.edge
            .iter()
            .enumerate()
            .filter(|(l, e)| !e.is_empty() && grew(*l))
            .map(|(l, e)| {
                let shift = (l as u32 + 1) * u32::from(TILE_HEIGHT);
                let index = if shift >= 64 { 0 } else { self.size >> shift };
                let width = (e.len() / tlog_tiles::HASH_SIZE) as u32;
                TileFile {
                    path: tile_path(l as u8, index, Some(width)),
                    bytes: e.clone(),
                }
            })
            .collect()
    }
}

impl HashReader for EdgeTree {
    fn read_hashes(&self, indexes: &[u64]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        indexes
            .iter()
            .map(|&i| {
                let tile = Tile::from_index(TILE_HEIGHT, i);
                let level = usize::from(tile.level());
                let shift = (level as u32 + 1) * u32::from(TILE_HEIGHT);
                let edge_index = if shift >= 64 { 0 } else { self.size >> shift };
                let data = self
                    .edge
                    .get(level)
                    .filter(|_| tile.level_index() == edge_index);
                // Anything off the edge is a bug in the argument above, not bad input.
                let data = data.ok_or(tlog_tiles::Error::IndexesNotInTree)?;
                tile.hash_at_index(data, i)
            })
            .collect()
    }
}

/// Checks `proof` that `leaf` is record `index` of the tree of `size` records whose root is
/// `root`.
pub fn verify_inclusion(
    proof: &RecordProof,
    size: u64,
    root: Hash,
    index: u64,
    leaf: Hash,
) -> Result<(), TlogError> {
    check_record(proof, size, root, index, leaf).map_err(TlogError::Invalid)
}

/// Checks `proof` that the tree of `new` records (root `new_root`) extends the tree of `old`
/// records (root `old_root`).
pub fn verify_consistency(
    proof: &TreeProof,
    new: u64,
    new_root: Hash,
    old: u64,
    old_root: Hash,
) -> Result<(), TlogError> {
    check_tree(proof, new, new_root, old, old_root).map_err(TlogError::Invalid)
}

/// The node's Ed25519 key as a C2SP signed-note signer (key type 0x01), under `name` (the
/// log's origin, as `tlog-checkpoint` recommends).
#[derive(Clone)]
pub struct NoteSigner {
    name: String,
    id: u32,
    key: ed25519_dalek::SigningKey,
}

impl std::fmt::Debug for NoteSigner {
    /// Name and key id; never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NoteSigner")
            .field("name", &self.name)
            .field("id", &format_args!("{:08x}", self.id))
            .finish()
    }
}

/// C2SP signed-note key type of an Ed25519 signature.
const ALG_ED25519: u8 = 0x01;

impl NoteSigner {
    pub fn new(name: &str, key: ed25519_dalek::SigningKey) -> Result<Self, TlogError> {
        if !signed_note::is_key_name_valid(name) {
            return Err(TlogError::BadKeyName(name.to_owned()));
        }
        let public = [&[ALG_ED25519][..], key.verifying_key().as_bytes()].concat();
        Ok(Self {
            name: name.to_owned(),
            id: signed_note::key_id(name, &public),
            key,
        })
    }

    /// The verifier key others pin: `<name>+<key id, hex>+<base64(0x01‖public key)>`.
    pub fn vkey(&self) -> String {
        signed_note::new_ed25519_verifier_key(&self.name, &self.key.verifying_key())
    }
}

impl signed_note::Signer for NoteSigner {
    fn name(&self) -> &str {
        &self.name
    }
    fn key_id(&self) -> u32 {
        self.id
    }
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, ed25519_dalek::SignatureError> {
        use ed25519_dalek::Signer as _;
        Ok(self.key.sign(msg).to_bytes().to_vec())
    }
}

/// The checkpoint of the tree of `size` records with root `root`, as a signed note: the C2SP
/// `tlog-checkpoint` text (origin = the signer's name) and the signer's line.
pub fn sign_checkpoint(signer: &NoteSigner, size: u64, root: Hash) -> Result<Vec<u8>, TlogError> {
    let text = tlog_tiles::Checkpoint::new(&signer.name, size, root, "")
        .map_err(|_| TlogError::MalformedCheckpoint)?
        .to_bytes();
    let mut note = signed_note::Note::new(&text, &[])?;
    note.add_sigs(&[signer])?;
    Ok(note.to_bytes())
}

/// The checkpoint a signed note carries, its signatures not checked (for reading its size or
/// origin before choosing the key; [`open_checkpoint`] checks them).
pub fn note_checkpoint(note: &[u8]) -> Result<Checkpoint, TlogError> {
    Checkpoint::from_bytes(note_text(note)).map_err(|_| TlogError::MalformedCheckpoint)
}

/// A signed note's text (through the newline before its blank line), its signatures left
/// unread.
pub fn note_text(note: &[u8]) -> &[u8] {
    let end = note
        .windows(2)
        .position(|w| w == b"\n\n")
        .map_or(note.len(), |i| i + 1);
    &note[..end]
}

/// The checkpoint in `note` if `vkey` signed it (lines of other keys, such as witnesses'
/// cosignatures, are left for their own checks).
pub fn open_checkpoint(note: &[u8], vkey: &str) -> Result<tlog_tiles::Checkpoint, TlogError> {
    let verifier = signed_note::StandardVerifier::new(vkey)?;
    let known = signed_note::VerifierList::new(vec![Box::new(verifier)]);
    let note = signed_note::Note::from_bytes(note)?;
    note.verify(&known)?;
    tlog_tiles::Checkpoint::from_bytes(note.text()).map_err(|_| TlogError::MalformedCheckpoint)
}

/// The first line of a C2SP `tlog-proof@v1` file.
pub const PROOF_HEADER: &str = "c2sp.org/tlog-proof@v1";
/// Hashes a proof may carry: a tree of 2^63 records needs 63; more is malformed (C2SP
/// `tlog-witness` allows up to 63 proof lines).
pub const MAX_PROOF_HASHES: usize = 63;

/// An inclusion proof in the C2SP `tlog-proof@v1` text format: optional extra data (here: the
/// record's canonical bytes, so the proof carries what it proves), the record's index, the
/// RFC 6962 inclusion proof, and the (co)signed checkpoint note it leads to.
#[derive(Debug, Clone, PartialEq)]
pub struct InclusionProof {
    pub extra: Option<Vec<u8>>,
    pub index: u64,
    pub hashes: Vec<Hash>,
    pub checkpoint: Vec<u8>,
}

/// A consistency proof as C2SP `tlog-witness` `add-checkpoint` takes it: the old size, the
/// RFC 6962 consistency proof from it, and the new checkpoint note — the request body a node
/// sends its witnesses.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsistencyProof {
    pub old: u64,
    pub hashes: Vec<Hash>,
    pub checkpoint: Vec<u8>,
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(s: &str) -> Result<Vec<u8>, TlogError> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|_| TlogError::MalformedProof("a line is not base64"))
}

/// Splits `text` at its first empty line: the header lines, and the checkpoint note after it.
fn split_at_blank(text: &[u8]) -> Result<(Vec<&str>, &[u8]), TlogError> {
    let cut = text
        .windows(2)
        .position(|w| w == b"\n\n")
        .ok_or(TlogError::MalformedProof(
            "no empty line before the checkpoint",
        ))?;
    let head =
        std::str::from_utf8(&text[..cut]).map_err(|_| TlogError::MalformedProof("not UTF-8"))?;
    Ok((head.split('\n').collect(), &text[cut + 2..]))
}

fn parse_hashes(lines: &[&str]) -> Result<Vec<Hash>, TlogError> {
    if lines.len() > MAX_PROOF_HASHES {
        return Err(TlogError::MalformedProof("more than 63 proof hashes"));
    }
    lines
        .iter()
        .map(|l| {
            let b: [u8; 32] = unb64(l)?
                .try_into()
                .map_err(|_| TlogError::MalformedProof("a proof hash is not 32 bytes"))?;
            Ok(Hash(b))
        })
        .collect()
}

/// A decimal with no sign, no leading zeros (as C2SP writes sizes and indexes).
fn parse_decimal(s: &str) -> Result<u64, TlogError> {
    let bad = TlogError::MalformedProof("not a decimal without leading zeros");
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad);
    }
    s.parse().map_err(|_| bad)
}

/// `head`, one base64 line per hash, an empty line, then the checkpoint note: the shape both
/// proof texts share.
fn hashes_then_note(mut head: String, hashes: &[Hash], checkpoint: &[u8]) -> Vec<u8> {
    for h in hashes {
        head.push_str(&b64(&h.0));
        head.push('\n');
    }
    head.push('\n');
    let mut out = head.into_bytes();
    out.extend_from_slice(checkpoint);
    out
}

impl InclusionProof {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!("{PROOF_HEADER}\n");
        if let Some(e) = &self.extra {
            out.push_str(&format!("extra {}\n", b64(e)));
        }
        out.push_str(&format!("index {}\n", self.index));
        hashes_then_note(out, &self.hashes, &self.checkpoint)
    }

    pub fn parse(text: &[u8]) -> Result<Self, TlogError> {
        let (lines, checkpoint) = split_at_blank(text)?;
        let mut it = lines.into_iter().peekable();
        if it.next() != Some(PROOF_HEADER) {
            return Err(TlogError::MalformedProof("not a c2sp.org/tlog-proof@v1"));
        }
        let extra = match it.peek().and_then(|l| l.strip_prefix("extra ")) {
            Some(e) => {
                let e = unb64(e)?;
                it.next();
                Some(e)
            }
            None => None,
        };
        let index = it
            .next()
            .and_then(|l| l.strip_prefix("index "))
            .ok_or(TlogError::MalformedProof("no index line"))?;
        let index = parse_decimal(index)?;
        let rest: Vec<&str> = it.collect();
        Ok(Self {
            extra,
            index,
            hashes: parse_hashes(&rest)?,
            checkpoint: checkpoint.to_vec(),
        })
    }

    /// Checks the proof against the log's verifier key: the checkpoint signed by it, and the
    /// record in `extra` (required) at `index` of that checkpoint's tree. Returns the checkpoint.
    pub fn verify(&self, log_vkey: &str) -> Result<tlog_tiles::Checkpoint, TlogError> {
        let record = self
            .extra
            .as_deref()
            .ok_or(TlogError::MalformedProof("no record (extra line) to prove"))?;
        self.verify_leaf(log_vkey, record_hash(record))
    }

    /// That `leaf` (a record's hash, as a receipt promise names it) is record `index` of the
    /// checkpoint's tree, the checkpoint signed by `log_vkey`; the proof's `extra`, if any, is
    /// not consulted.
    pub fn verify_leaf(
        &self,
        log_vkey: &str,
        leaf: Hash,
    ) -> Result<tlog_tiles::Checkpoint, TlogError> {
        let cp = open_checkpoint(&self.checkpoint, log_vkey)?;
        verify_inclusion(&self.hashes, cp.size(), *cp.hash(), self.index, leaf)?;
        Ok(cp)
    }
}

impl ConsistencyProof {
    pub fn to_bytes(&self) -> Vec<u8> {
        hashes_then_note(
            format!("old {}\n", self.old),
            &self.hashes,
            &self.checkpoint,
        )
    }

    pub fn parse(text: &[u8]) -> Result<Self, TlogError> {
        let (lines, checkpoint) = split_at_blank(text)?;
        let (first, rest) = lines
            .split_first()
            .ok_or(TlogError::MalformedProof("empty"))?;
        let old = first
            .strip_prefix("old ")
            .ok_or(TlogError::MalformedProof("no old line"))?;
        Ok(Self {
            old: parse_decimal(old)?,
            hashes: parse_hashes(rest)?,
            checkpoint: checkpoint.to_vec(),
        })
    }
}

/// One tile to write: its C2SP path (under the log's prefix) and its hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TileFile {
    pub path: String,
    pub bytes: Vec<u8>,
}

/// C2SP `tlog-tiles` path of the tile at `level`, `index` within it, and `partial` width:
/// `tile/<L>/<N>[.p/<W>]`, N written in groups of three digits, each but the last prefixed
/// with `x` (1234067 → `x001/x234/067`).
pub fn tile_path(level: u8, index: u64, partial: Option<u32>) -> String {
    let digits = format!("{index:03}");
    let pad = (3 - digits.len() % 3) % 3;
    let digits = format!("{}{digits}", "0".repeat(pad));
    let groups: Vec<&str> = digits
        .as_bytes()
        .chunks(3)
        .map(|c| std::str::from_utf8(c).unwrap_or("000"))
        .collect();
    let last = groups.len() - 1;
    let mut path = format!("tile/{level}");
    for (i, g) in groups.iter().enumerate() {
        path.push('/');
        if i < last {
            path.push('x');
        }
        path.push_str(g);
    }
    if let Some(w) = partial {
        path.push_str(&format!(".p/{w}"));
    }
    path
}

/// Whether `path` names a full tile of level 0 (the leaves' hashes, 256 of them).
pub fn is_full_level0(path: &str) -> bool {
    path.starts_with("tile/0/") && !path.contains(".p/")
}

/// A tile named by [`tile_path`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileName {
    pub level: u8,
    pub index: u64,
    /// `None`: a full tile.
    pub partial: Option<u32>,
}

/// Reads a C2SP tile path back (the inverse of [`tile_path`]), refusing any other spelling.
pub fn parse_tile_path(path: &str) -> Result<TileName, TlogError> {
    let bad = || TlogError::BadTilePath(path.to_owned());
    let rest = path.strip_prefix("tile/").ok_or_else(bad)?;
    let (body, partial) = match rest.split_once(".p/") {
        Some((b, w)) => {
            let w: u32 = w.parse().map_err(|_| bad())?;
            if !(1..(1 << TILE_HEIGHT)).contains(&w) {
                return Err(bad());
            }
            (b, Some(w))
        }
        None => (rest, None),
    };
    let mut parts = body.split('/');
    let level: u8 = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let groups: Vec<&str> = parts.collect();
    let (last, leading) = groups.split_last().ok_or_else(bad)?;
    let mut digits = String::new();
    for g in leading {
        let g = g.strip_prefix('x').ok_or_else(bad)?;
        digits.push_str(g);
    }
    digits.push_str(last);
    let index: u64 = digits.parse().map_err(|_| bad())?;
    let name = TileName {
        level,
        index,
        partial,
    };
    // One spelling only (three-digit groups, no leading zeros in the width).
    if tile_path(level, index, partial) != path {
        return Err(bad());
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    fn h(s: &str) -> Hash {
        Hash(hex(s).try_into().expect("32 bytes"))
    }

    /// transparency-dev/merkle `testonly/constants.go`: `LeafInputs`, `RootHashes`.
    const LEAVES: [&str; 8] = [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ];
    const ROOTS: [&str; 9] = [
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
        "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
        "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
        "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
    ];

    fn vector_tree() -> Tree {
        let mut t = Tree::new();
        for l in LEAVES {
            t.append(&hex(l)).expect("append");
        }
        t
    }

    #[test]
    fn roots_are_rfc_6962s_for_every_size() {
        let t = vector_tree();
        for (size, want) in ROOTS.iter().enumerate() {
            assert_eq!(t.root(size as u64).expect("root"), h(want), "size {size}");
        }
        assert!(matches!(t.root(9), Err(TlogError::PastTheTree { .. })));
    }

    /// transparency-dev/merkle `proof/verify_test.go` (its leaf numbers are 1-based).
    #[test]
    fn proofs_are_the_reference_vectors_and_check() {
        let t = vector_tree();
        let inclusion: [(u64, u64, &[&str]); 4] = [
            (
                1,
                8,
                &[
                    "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
                ],
            ),
            (
                6,
                8,
                &[
                    "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                    "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
                    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
                ],
            ),
            (
                3,
                3,
                &["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"],
            ),
            (
                2,
                5,
                &[
                    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                ],
            ),
        ];
        for (leaf1, size, want) in inclusion {
            let index = leaf1 - 1;
            let p = t.prove_inclusion(index, size).expect("prove");
            let want: Vec<Hash> = want.iter().map(|s| h(s)).collect();
            assert_eq!(p, want, "inclusion of {index} in {size}");
            let leaf = record_hash(&hex(LEAVES[index as usize]));
            let root = t.root(size).expect("root");
            verify_inclusion(&p, size, root, index, leaf).expect("checks");
            // A proof for another leaf, index or root fails.
            let other = record_hash(b"not the record");
            assert!(verify_inclusion(&p, size, root, index, other).is_err());
            assert!(verify_inclusion(&p, size, other, index, leaf).is_err());
        }
        let consistency: [(u64, u64, &[&str]); 4] = [
            (
                1,
                8,
                &[
                    "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
                ],
            ),
            (
                6,
                8,
                &[
                    "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
                    "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
                    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
                ],
            ),
            (
                2,
                5,
                &[
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                ],
            ),
            (
                6,
                7,
                &[
                    "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
                    "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
                    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
                ],
            ),
        ];
        for (old, new, want) in consistency {
            let p = t.prove_consistency(old, new).expect("prove");
            let want: Vec<Hash> = want.iter().map(|s| h(s)).collect();
            assert_eq!(p, want, "consistency {old} → {new}");
            let (ro, rn) = (t.root(old).expect("old"), t.root(new).expect("new"));
            verify_consistency(&p, new, rn, old, ro).expect("checks");
            assert!(verify_consistency(&p, new, rn, old, rn).is_err() || ro == rn);
        }
        assert!(t.prove_consistency(1, 1).expect("same size").is_empty());
        assert!(matches!(
            t.prove_consistency(0, 4),
            Err(TlogError::BadSizes { .. })
        ));
        assert!(matches!(
            t.prove_inclusion(8, 8),
            Err(TlogError::PastTheTree { .. })
        ));
    }

    /// Go's `sumdb/note` example: the same key signs the same text to the same line
    /// (Ed25519 is deterministic), and the checkpoint round trip holds.
    #[test]
    fn notes_are_signed_as_gos_sumdb_note_signs_them() {
        use signed_note::Signer as _;
        let skey = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz";
        let vkey = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW";
        let text = b"If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n";
        let want = "\u{2014} PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n";
        // The seed: the base64 after `PRIVATE+KEY+<name>+<id>+`, past its type byte.
        let seed: [u8; 32] = {
            use base64::Engine as _;
            let raw = base64::engine::general_purpose::STANDARD
                .decode(skey.splitn(5, '+').nth(4).expect("key"))
                .expect("base64");
            raw[1..].try_into().expect("32 bytes")
        };
        let ours = NoteSigner::new("PeterNeumann", ed25519_dalek::SigningKey::from_bytes(&seed))
            .expect("signer");
        assert_eq!(ours.vkey(), vkey);
        assert_eq!(ours.key_id(), 0xc74f20a3);
        let mut note = signed_note::Note::new(text, &[]).expect("note");
        note.add_sigs(&[&ours]).expect("signs");
        let bytes = note.to_bytes();
        let sig_line = std::str::from_utf8(&bytes[text.len() + 1..]).expect("utf-8");
        assert_eq!(sig_line, want);

        let signer = NoteSigner::new(
            "custody.invalid/node-1",
            ed25519_dalek::SigningKey::from_bytes(&[7; 32]),
        )
        .expect("signer");
        let t = vector_tree();
        let note = sign_checkpoint(&signer, 8, t.root(8).expect("root")).expect("signed");
        let c = open_checkpoint(&note, &signer.vkey()).expect("opens");
        assert_eq!(
            (c.origin(), c.size(), *c.hash()),
            ("custody.invalid/node-1", 8, h(ROOTS[8]))
        );
        // Another key's vkey, or a changed size, does not open it.
        let other = NoteSigner::new(
            "custody.invalid/node-1",
            ed25519_dalek::SigningKey::from_bytes(&[8; 32]),
        )
        .expect("signer");
        assert!(open_checkpoint(&note, &other.vkey()).is_err());
        let forged = String::from_utf8(note.clone())
            .expect("utf-8")
            .replacen("\n8\n", "\n9\n", 1);
        assert!(open_checkpoint(forged.as_bytes(), &signer.vkey()).is_err());
        assert!(
            NoteSigner::new("has space", ed25519_dalek::SigningKey::from_bytes(&[7; 32])).is_err()
        );
    }

    #[test]
    fn tile_paths_are_c2sps() {
        assert_eq!(tile_path(0, 1_234_067, None), "tile/0/x001/x234/067");
        assert_eq!(tile_path(1, 0, Some(17)), "tile/1/000.p/17");
        assert_eq!(tile_path(2, 1000, None), "tile/2/x001/000");
        for (l, n, w) in [(0u8, 0u64, None), (0, 1_234_067, Some(5)), (3, 999, None)] {
            let p = tile_path(l, n, w);
            assert_eq!(
                parse_tile_path(&p).expect("parses"),
                TileName {
                    level: l,
                    index: n,
                    partial: w
                }
            );
        }
        for bad in [
            "tile/0/1234067",
            "tile/0/x1/234",
            "tile/0/001.p/0",
            "tile/0/001.p/256",
            "tiles/0/001",
            "tile/0/x001",
            "tile/0/01",
        ] {
            assert!(parse_tile_path(bad).is_err(), "{bad}");
        }
    }

    /// The C2SP `tlog-tiles` spec's examples: 70,000 records make 273 full level-0 tiles and
    /// a partial of 112, one full level-1 tile and a partial (the second) of 17, a level-2 partial
    /// of 1; 256
    /// make one full level-0 tile and a level-1 partial of 1. A tile's bytes are its hashes, and
    /// a full level-1 tile's hashes are the roots of the level-0 tiles under it.
    #[test]
    fn tiles_follow_the_specs_examples() {
        let mut t = Tree::new();
        for i in 0..70_000u32 {
            t.append(&i.to_be_bytes()).expect("append");
        }
        let tiles = t.tiles(0, 70_000).expect("tiles");
        let count = |prefix: &str, partial: bool| {
            tiles
                .iter()
                .filter(|f| f.path.starts_with(prefix) && f.path.contains(".p/") == partial)
                .count()
        };
        assert_eq!(count("tile/0/", false), 273);
        assert_eq!(count("tile/1/", false), 1);
        let partials: Vec<&str> = tiles
            .iter()
            .filter(|f| f.path.contains(".p/"))
            .map(|f| f.path.as_str())
            .collect();
        assert_eq!(
            partials,
            ["tile/0/273.p/112", "tile/1/001.p/17", "tile/2/000.p/1"]
        );
        assert!(tiles.iter().all(|f| {
            let name = parse_tile_path(&f.path).expect("c2sp");
            f.bytes.len() == 32 * name.partial.map_or(256, |w| w as usize)
        }));
        let level1 = &tiles
            .iter()
            .find(|f| f.path == "tile/1/000")
            .expect("level 1")
            .bytes;
        let first_tile_root = t.root(256).expect("root of 256");
        assert_eq!(&level1[..32], &first_tile_root.0);

        let mut small = Tree::new();
        for i in 0..256u32 {
            small.append(&i.to_be_bytes()).expect("append");
        }
        let paths: Vec<String> = small
            .tiles(0, 256)
            .expect("tiles")
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(paths, ["tile/0/000", "tile/1/000.p/1"]);
        // Growing 256 → 300 writes only what changed: the new partial level-0 tile (the
        // level-1 tile still covers one full tile).
        for i in 256..300u32 {
            small.append(&i.to_be_bytes()).expect("append");
        }
        let grown: Vec<String> = small
            .tiles(256, 300)
            .expect("tiles")
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(grown, ["tile/0/001.p/44"]);
    }

    /// The edge tree (O(log n) memory) grows the tree `Tree` (every hash in memory) grows:
    /// the same root after every step, and between steps exactly the tiles `tlog_tiles` says
    /// changed — full ones as they fill, partial ones as they stand. Steps cross tile
    /// boundaries at levels 0, 1 and 2 (70,000 records); the edge rebuilt from its partial
    /// tiles goes on the same way.
    #[test]
    fn the_edge_tree_grows_as_the_whole_tree_does() {
        let mut whole = Tree::new();
        let mut edge = EdgeTree::new();
        assert_eq!(edge.root().expect("empty"), whole.root(0).expect("empty"));
        let mut old = 0u64;
        for step in [1u64, 1, 5, 249, 256, 300, 65_536 - 812, 1, 4_463] {
            for i in old..old + step {
                let leaf = record_hash(&i.to_be_bytes());
                assert_eq!(edge.append_leaf(leaf).expect("edge"), i);
                whole.append_leaf(leaf).expect("whole");
            }
            let new = old + step;
            assert_eq!(
                edge.root().expect("root"),
                whole.root(new).expect("root"),
                "{new}"
            );
            let mut got = edge.take_full_tiles();
            got.extend(edge.partial_tiles(old));
            let mut want = whole.tiles(old, new).expect("tiles");
            got.sort_by(|a, b| a.path.cmp(&b.path));
            want.sort_by(|a, b| a.path.cmp(&b.path));
            assert_eq!(got, want, "tiles from {old} to {new}");
            old = new;
        }
        assert_eq!(old, 70_000);
        let partials: Vec<Vec<u8>> = edge.partial_tiles(0).into_iter().map(|t| t.bytes).collect();
        let mut reopened = EdgeTree::from_partials(old, partials.clone()).expect("reopen");
        assert_eq!(
            reopened.root().expect("root"),
            whole.root(old).expect("root")
        );
        for i in old..old + 600 {
            let leaf = record_hash(&i.to_be_bytes());
            reopened.append_leaf(leaf).expect("edge");
            whole.append_leaf(leaf).expect("whole");
        }
        assert_eq!(
            reopened.root().expect("root"),
            whole.root(old + 600).expect("root")
        );
        // Partial tiles of another size are refused, not misread.
        assert!(matches!(
            EdgeTree::from_partials(old + 1, partials.clone()),
            Err(TlogError::EdgeMismatch { level: 0, .. })
        ));
        assert!(matches!(
            EdgeTree::from_partials(old, partials[..2].to_vec()),
            Err(TlogError::EdgeMismatch { level: 2, .. })
        ));
    }

    /// The C2SP `tlog-proof@v1` text, as the format's reference tests write it (the hashes are
    /// SHA-256 of "hash1" and "hash2"), read back; malformed ones refused.
    #[test]
    fn proofs_are_c2sp_text() {
        let h1 = h("af316ecb91a8ee7ae99210702b2d4758f30cdde3bf61e3d8e787d74681f90a6e");
        let h2 = h("e7bf382f6e5915b3f88619b866223ebf1d51c4c5321cccde2e9ff700a3259086");
        let p = InclusionProof {
            extra: None,
            index: 5,
            hashes: vec![h1, h2],
            checkpoint: b"test checkpoint\n".to_vec(),
        };
        let text = "c2sp.org/tlog-proof@v1\nindex 5\nrzFuy5Go7nrpkhBwKy1HWPMM3eO/YePY54fXRoH5Cm4=\n5784L25ZFbP4hhm4ZiI+vx1RxMUyHMzeLp/3AKMlkIY=\n\ntest checkpoint\n";
        assert_eq!(String::from_utf8(p.to_bytes()).expect("utf-8"), text);
        assert_eq!(InclusionProof::parse(text.as_bytes()).expect("parse"), p);
        let with_extra = InclusionProof {
            extra: Some(b"extra information".to_vec()),
            index: 10,
            hashes: vec![h1],
            checkpoint: b"checkpoint data\n".to_vec(),
        };
        let text = "c2sp.org/tlog-proof@v1\nextra ZXh0cmEgaW5mb3JtYXRpb24=\nindex 10\nrzFuy5Go7nrpkhBwKy1HWPMM3eO/YePY54fXRoH5Cm4=\n\ncheckpoint data\n";
        assert_eq!(
            String::from_utf8(with_extra.to_bytes()).expect("utf-8"),
            text
        );
        assert_eq!(
            InclusionProof::parse(text.as_bytes()).expect("parse"),
            with_extra
        );
        for bad in [
            "wrong-header\nindex 0\n\ncp\n",
            "c2sp.org/tlog-proof@v1\nindex 01\n\ncp\n",
            "c2sp.org/tlog-proof@v1\nindex 1\nnot base64!\n\ncp\n",
            "c2sp.org/tlog-proof@v1\nindex 1\nAAAA\n\ncp\n",
            "c2sp.org/tlog-proof@v1\nindex 1\n",
        ] {
            assert!(InclusionProof::parse(bad.as_bytes()).is_err(), "{bad:?}");
        }
        let c = ConsistencyProof {
            old: 3,
            hashes: vec![h2],
            checkpoint: b"cp\n".to_vec(),
        };
        let text = "old 3\n5784L25ZFbP4hhm4ZiI+vx1RxMUyHMzeLp/3AKMlkIY=\n\ncp\n";
        assert_eq!(String::from_utf8(c.to_bytes()).expect("utf-8"), text);
        assert_eq!(ConsistencyProof::parse(text.as_bytes()).expect("parse"), c);
        assert!(ConsistencyProof::parse(b"new 3\n\ncp\n").is_err());
    }
}

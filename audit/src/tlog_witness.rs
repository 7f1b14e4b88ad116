//! A transparency-log witness (C2SP `tlog-witness` v1.0.0 `add-checkpoint`): an independent
//! process, with its own key and storage, that cosigns a node's checkpoint only if the node
//! proves it consistent with the last one the witness cosigned — so a node (or whoever holds
//! its key) cannot show two histories to two parties once a witness has seen one. Called the
//! *tlog witness* (or cosigner) in the docs: "the witness" alone is the eBPF witness.
//!
//! Per origin it keeps the newest cosigned checkpoint (`<state>/logs/<sha256(origin)>.json`),
//! updated atomically and durably before it answers. A signed checkpoint that contradicts it —
//! the same size with another root, a smaller tree, or no valid consistency proof from it — is
//! refused and kept with the cosigned one as evidence (`<state>/evidence/`).
//!
//! HTTP status of each outcome (the spec's): 404 unknown origin, 403 no valid signature of the
//! log, 400 malformed or `old` > size, 409 `old` is not the size the witness has (the body is
//! the witness's size), 422 inconsistent (a bad proof, a proof with `old` = 0, another root at
//! the same size), 200 the cosignature line.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ed25519_dalek::SigningKey;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::cosign::CosignatureSigner;
use crate::tlog::{self, ConsistencyProof, Hash, TlogError};

/// Why `add-checkpoint` refused, with the HTTP status the spec gives it.
#[derive(Debug, thiserror::Error)]
pub enum AddError {
    #[error("malformed request: {0}")]
    BadRequest(String),
    #[error("unknown log origin {0:?}")]
    UnknownOrigin(String),
    #[error("the checkpoint is not signed by the log's key: {0}")]
    Forbidden(String),
    #[error("old size {offered} is not the {cosigned} records this witness last cosigned")]
    Conflict { offered: u64, cosigned: u64 },
    #[error("inconsistent with the cosigned checkpoint: {0}")]
    Unprocessable(String),
    #[error("the witness's state at {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl AddError {
    /// The HTTP status C2SP `tlog-witness` gives this outcome.
    pub fn status(&self) -> u16 {
        match self {
            AddError::BadRequest(_) => 400,
            AddError::Forbidden(_) => 403,
            AddError::UnknownOrigin(_) => 404,
            AddError::Conflict { .. } => 409,
            AddError::Unprocessable(_) => 422,
            AddError::Io { .. } => 500,
        }
    }

    /// The response body: the witness's size for a 409 (`text/x.tlog.size`), else the message.
    pub fn body(&self) -> String {
        match self {
            AddError::Conflict { cosigned, .. } => format!("{cosigned}\n"),
            e => format!("{e}\n"),
        }
    }
}

/// What a witness keeps per log: its newest cosigned checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct LogState {
    origin: String,
    size: u64,
    /// Base64, as in the checkpoint.
    root: String,
    /// The checkpoint note as the log signed it, with this witness's cosignature.
    note: String,
}

/// A signed checkpoint the witness refused because it contradicts one it cosigned.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Evidence {
    pub origin: String,
    /// `same-size-other-root` (two signed trees of one size: a fork, proven by the two notes),
    /// `smaller-tree` (a rolled-back log), or `inconsistent` (no valid consistency proof from the
    /// cosigned tree to the offered one).
    pub kind: String,
    pub why: String,
    /// When the witness saw it (POSIX seconds).
    pub seen_s: u64,
    /// The checkpoint the witness had cosigned (with its cosignature).
    pub cosigned: String,
    /// The contradicting checkpoint, as the log signed it.
    pub offered: String,
}

/// A witness over the logs it was configured with.
pub struct Witness {
    name: String,
    key: SigningKey,
    dir: PathBuf,
    /// Origin → the log's signed-note verifier key.
    logs: BTreeMap<String, String>,
    /// One `add-checkpoint` at a time: the check and the update are atomic.
    lock: Mutex<()>,
}

impl std::fmt::Debug for Witness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Witness")
            .field("name", &self.name)
            .field("dir", &self.dir)
            .field("logs", &self.logs.keys().collect::<Vec<_>>())
            .finish()
    }
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> AddError + '_ {
    move |source| AddError::Io {
        path: path.to_owned(),
        source,
    }
}

/// `hex(SHA-256(origin))`: a file name for any origin (the spec's monitoring path uses it too).
pub fn origin_id(origin: &str) -> String {
    Sha256::digest(origin.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Witness {
    /// A witness named `name` (its cosignatures' key name) with `key`, keeping its state in
    /// `dir`, for the logs whose signed-note verifier keys are `log_vkeys` (origin = key name).
    pub fn open(
        name: &str,
        key: SigningKey,
        dir: &Path,
        log_vkeys: &[String],
    ) -> Result<Self, TlogError> {
        // Checks the name once, here.
        CosignatureSigner::new(name, key.clone(), 1)?;
        let mut logs = BTreeMap::new();
        for v in log_vkeys {
            signed_note::StandardVerifier::new(v)?;
            let origin = v.split('+').next().unwrap_or_default().to_owned();
            logs.insert(origin, v.clone());
        }
        Ok(Self {
            name: name.to_owned(),
            key,
            dir: dir.to_owned(),
            logs,
            lock: Mutex::new(()),
        })
    }

    /// This witness's cosignature verifier key (what nodes and verifiers pin).
    pub fn vkey(&self) -> String {
        crate::cosign::vkey(&self.name, &self.key.verifying_key())
    }

    fn state_path(&self, origin: &str) -> PathBuf {
        self.dir
            .join("logs")
            .join(format!("{}.json", origin_id(origin)))
    }

    fn load(&self, origin: &str) -> Result<Option<LogState>, AddError> {
        let p = self.state_path(origin);
        match fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| io_at(&p)(std::io::Error::other(e))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_at(&p)(e)),
        }
    }

    /// The newest checkpoint this witness cosigned for `origin` (with its cosignature).
    pub fn latest(&self, origin: &str) -> Result<Option<Vec<u8>>, AddError> {
        Ok(self.load(origin)?.map(|s| s.note.into_bytes()))
    }

    /// [`Witness::latest`] by `hex(SHA-256(origin))` (the spec's monitoring path).
    pub fn latest_by_id(&self, id: &str) -> Result<Option<Vec<u8>>, AddError> {
        match self.logs.keys().find(|o| origin_id(o) == id) {
            Some(o) => self.latest(&o.clone()),
            None => Ok(None),
        }
    }

    /// C2SP `add-checkpoint`: the request body (`old <size>`, the consistency proof, the signed
    /// checkpoint); on success, this witness's cosignature line(s) for it, made at `now_s`.
    pub fn add_checkpoint(&self, body: &[u8], now_s: u64) -> Result<Vec<u8>, AddError> {
        let req = ConsistencyProof::parse(body).map_err(|e| AddError::BadRequest(e.to_string()))?;
        let note = signed_note::Note::from_bytes(&req.checkpoint)
            .map_err(|e| AddError::BadRequest(format!("the checkpoint: {e}")))?;
        let cp = tlog::Checkpoint::from_bytes(note.text())
            .map_err(|e| AddError::BadRequest(format!("the checkpoint: {e}")))?;
        let origin = cp.origin().to_owned();
        let vkey = self
            .logs
            .get(&origin)
            .ok_or_else(|| AddError::UnknownOrigin(origin.clone()))?;
        tlog::open_checkpoint(&req.checkpoint, vkey)
            .map_err(|e| AddError::Forbidden(e.to_string()))?;
        let (size, root) = (cp.size(), *cp.hash());
        if req.old > size {
            return Err(AddError::BadRequest(format!(
                "old size {} is past the checkpoint's {size}",
                req.old
            )));
        }
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let state = self.load(&origin)?;
        let (have_size, have_root) = match &state {
            Some(s) => (s.size, Some(parse_root(&s.root)?)),
            None => (0, None),
        };
        if let (Some(s), Some(have)) = (&state, have_root) {
            if size == s.size && root != have {
                let why = format!("a second tree of {size} records with another root");
                self.keep_evidence(s, &req.checkpoint, "same-size-other-root", &why, now_s)?;
                return Err(AddError::Unprocessable(why));
            }
            if size < s.size {
                let why = format!("a tree of {size} records after one of {}", s.size);
                self.keep_evidence(s, &req.checkpoint, "smaller-tree", &why, now_s)?;
                return Err(AddError::Conflict {
                    offered: req.old,
                    cosigned: s.size,
                });
            }
        }
        if req.old != have_size {
            return Err(AddError::Conflict {
                offered: req.old,
                cosigned: have_size,
            });
        }
        if size == 0 && root != tlog::EdgeTree::new().root().map_err(bad_tree)? {
            return Err(AddError::Unprocessable("an empty tree with a root".into()));
        }
        if req.old == 0 || req.old == size {
            if !req.hashes.is_empty() {
                return Err(AddError::Unprocessable(
                    "a consistency proof where none is needed".into(),
                ));
            }
        } else if let (Some(s), Some(have)) = (&state, have_root)
            && let Err(e) = tlog::verify_consistency(&req.hashes, size, root, s.size, have)
        {
            let why = format!("no valid consistency proof from {} records: {e}", s.size);
            self.keep_evidence(s, &req.checkpoint, "inconsistent", &why, now_s)?;
            return Err(AddError::Unprocessable(why));
        }
        self.cosign_and_keep(&origin, &req.checkpoint, size, root, now_s)
    }

    fn cosign_and_keep(
        &self,
        origin: &str,
        checkpoint: &[u8],
        size: u64,
        root: Hash,
        now_s: u64,
    ) -> Result<Vec<u8>, AddError> {
        let signer = CosignatureSigner::new(&self.name, self.key.clone(), now_s.max(1))
            .map_err(|e| AddError::BadRequest(e.to_string()))?;
        let mut note = signed_note::Note::from_bytes(checkpoint)
            .map_err(|e| AddError::BadRequest(e.to_string()))?;
        note.add_sigs(&[&signer])
            .map_err(|e| AddError::BadRequest(e.to_string()))?;
        let cosigned = note.to_bytes();
        let ours: Vec<u8> = String::from_utf8_lossy(&cosigned)
            .lines()
            .filter(|l| l.starts_with(&format!("— {} ", self.name)))
            .flat_map(|l| format!("{l}\n").into_bytes())
            .collect();
        let state = LogState {
            origin: origin.to_owned(),
            size,
            root: b64(&root.0),
            note: String::from_utf8_lossy(&cosigned).into_owned(),
        };
        let bytes = serde_json::to_vec_pretty(&state).unwrap_or_default();
        write_durably(&self.state_path(origin), &bytes)?;
        Ok(ours)
    }

    fn keep_evidence(
        &self,
        cosigned: &LogState,
        offered: &[u8],
        kind: &str,
        why: &str,
        now_s: u64,
    ) -> Result<(), AddError> {
        let e = Evidence {
            origin: cosigned.origin.clone(),
            kind: kind.to_owned(),
            why: why.to_owned(),
            seen_s: now_s,
            cosigned: cosigned.note.clone(),
            offered: String::from_utf8_lossy(offered).into_owned(),
        };
        tracing::error!(origin = %e.origin, kind, why, "tlog witness: a checkpoint contradicts the one it cosigned; kept as evidence");
        let dir = self.dir.join("evidence");
        let name = format!(
            "{}-{now_s}-{}.json",
            origin_id(&e.origin),
            &origin_id(&e.offered)[..16]
        );
        let bytes = serde_json::to_vec_pretty(&e).unwrap_or_default();
        write_durably(&dir.join(name), &bytes)
    }
}

fn bad_tree(e: TlogError) -> AddError {
    AddError::Unprocessable(e.to_string())
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn parse_root(s: &str) -> Result<Hash, AddError> {
    Hash::parse_hash(s).map_err(|e| AddError::Unprocessable(format!("stored root: {e}")))
}

fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), AddError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_at(dir))?;
    let tmp = path.with_extension("tmp");
    let res: std::io::Result<()> = (|| {
        let mut f = fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut f, bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        fs::File::open(dir)?.sync_all()
    })();
    res.map_err(io_at(path))
}

/// A tlog witness a node sends its checkpoints to.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WitnessTarget {
    /// `http://host:port[/prefix]`: the witness's `add-checkpoint` is `<url>/add-checkpoint`.
    pub url: String,
    /// Its cosignature verifier key (`custody witness vkey`).
    pub vkey: String,
}

/// An HTTP reply, as a [`WitnessTransport`] hands it back.
#[derive(Debug, Clone)]
pub struct HttpReply {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Why a request did not reach a witness (refused connection, timeout, a malformed reply).
#[derive(Debug, thiserror::Error)]
#[error("{url}: {why}")]
pub struct TransportError {
    pub url: String,
    pub why: String,
}

/// How the node reaches its witnesses (the binary's HTTP client; this crate knows no network).
pub trait WitnessTransport: Send + Sync {
    fn post(&self, url: &str, body: &[u8]) -> Result<HttpReply, TransportError>;
}

/// Every piece of evidence a witness kept under `dir`, oldest first.
pub fn evidence(dir: &Path) -> Result<Vec<Evidence>, AddError> {
    let ev = dir.join("evidence");
    let mut names: Vec<PathBuf> = match fs::read_dir(&ev) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_at(&ev)(e)),
    };
    names.sort();
    let mut out: Vec<Evidence> = names
        .iter()
        .map(|p| {
            let b = fs::read(p).map_err(io_at(p))?;
            serde_json::from_slice(&b).map_err(|e| io_at(p)(std::io::Error::other(e)))
        })
        .collect::<Result<_, _>>()?;
    out.sort_by_key(|e| e.seen_s);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tlog::{NoteSigner, Tree, sign_checkpoint};

    fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn tree(n: u64, salt: u8) -> Tree {
        let mut t = Tree::new();
        for i in 0..n {
            t.append(&[&i.to_be_bytes()[..], &[salt]].concat())
                .expect("append");
        }
        t
    }

    fn body(log: &NoteSigner, t: &Tree, old: u64, size: u64) -> Vec<u8> {
        let hashes = if old == 0 || old >= size {
            Vec::new()
        } else {
            t.prove_consistency(old, size).expect("proof")
        };
        ConsistencyProof {
            old,
            hashes,
            checkpoint: sign_checkpoint(log, size, t.root(size).expect("root")).expect("note"),
        }
        .to_bytes()
    }

    /// Every status of the spec, the state kept across a restart, and the evidence of a fork
    /// (same size, another root), a rollback and an inconsistent tree.
    #[test]
    fn add_checkpoint_answers_as_the_spec_says() {
        let dir = std::env::temp_dir().join(format!("custody-witness-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let log = NoteSigner::new("example.com/log", key(1)).expect("log");
        let w = Witness::open("w.example", key(2), &dir, &[log.vkey()]).expect("witness");
        let t = tree(40, 0);
        // First checkpoint: old 0, no proof.
        let line = w
            .add_checkpoint(&body(&log, &t, 0, 10), 100)
            .expect("first");
        assert!(String::from_utf8_lossy(&line).starts_with("— w.example "));
        let cosigned = w.latest("example.com/log").expect("state").expect("kept");
        let got = crate::cosign::cosignatures(&cosigned, &[w.vkey()]).expect("check");
        assert_eq!(got[0].time_s, 100);
        // A consistent extension.
        w.add_checkpoint(&body(&log, &t, 10, 25), 101)
            .expect("extend");
        // The same checkpoint again is cosigned again (old = size, no proof).
        w.add_checkpoint(&body(&log, &t, 25, 25), 102)
            .expect("same");
        let status = |b: &[u8]| {
            w.add_checkpoint(b, 103)
                .map(|_| 200)
                .unwrap_or_else(|e| e.status())
        };
        assert_eq!(status(b"not a request"), 400);
        assert_eq!(status(&body(&log, &t, 30, 25)), 400, "old past the size");
        let other = NoteSigner::new("other.example/log", key(3)).expect("other");
        assert_eq!(status(&body(&other, &t, 0, 5)), 404);
        let forger = NoteSigner::new("example.com/log", key(4)).expect("forger");
        assert_eq!(status(&body(&forger, &t, 25, 30)), 403);
        let e = w
            .add_checkpoint(&body(&log, &t, 10, 30), 103)
            .expect_err("stale old");
        assert_eq!((e.status(), e.body()), (409, "25\n".to_owned()));
        let mut bad_proof = ConsistencyProof::parse(&body(&log, &t, 25, 30)).expect("parse");
        bad_proof.hashes[0].0[0] ^= 1;
        assert_eq!(status(&bad_proof.to_bytes()), 422);
        assert!(
            evidence(&dir)
                .expect("evidence")
                .iter()
                .any(|e| e.kind == "inconsistent")
        );
        // A fork: the log's own key signs another tree of the size the witness cosigned.
        let fork = tree(40, 1);
        assert_eq!(status(&body(&log, &fork, 25, 25)), 422);
        // A rollback: a smaller tree, signed.
        assert_eq!(status(&body(&log, &t, 0, 20)), 409);
        let kinds: Vec<String> = evidence(&dir)
            .expect("evidence")
            .into_iter()
            .map(|e| e.kind)
            .collect();
        assert!(
            kinds.contains(&"same-size-other-root".to_owned()),
            "{kinds:?}"
        );
        assert!(kinds.contains(&"smaller-tree".to_owned()), "{kinds:?}");
        // The state survives a restart; the consistent history goes on.
        drop(w);
        let w = Witness::open("w.example", key(2), &dir, &[log.vkey()]).expect("reopen");
        w.add_checkpoint(&body(&log, &t, 25, 40), 104)
            .expect("after restart");
        let _ = fs::remove_dir_all(&dir);
    }
}

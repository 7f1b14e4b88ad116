//! Tamper evidence, after AWS CloudTrail's log-file validation.
//!
//! Every seal writes `_digests/node=<id>/<digest_seq>.json`: the SHA-256, size and row count of
//! each sealed Parquet file, the node sequence range it covers, the SHA-256 of the previous digest
//! file and the previous digest's signature, all signed with the node's Ed25519 key (the signature
//! covers the canonical JSON of every other field). [`verify`] walks the chain and reports every
//! modified, truncated, missing, extra or reordered file, every broken or reordered digest link,
//! every bad signature and every sequence gap.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

pub const DIGEST_FORMAT: &str = "custody-audit-digest-1";

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
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
}

pub fn digest_dir(root: &Path, node: u32) -> PathBuf {
    root.join("_digests").join(format!("node={node}"))
}

fn canonical(body: &DigestBody) -> Vec<u8> {
    // serde_json writes struct fields in declaration order: deterministic bytes.
    serde_json::to_vec(body).unwrap_or_default()
}

impl ChainHead {
    pub fn load(root: &Path, node: u32) -> Result<Self, String> {
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
        let bytes = fs::read(last).map_err(|e| format!("{}: {e}", last.display()))?;
        let d: DigestFile =
            serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", last.display()))?;
        Ok(Self {
            next_seq: d.body.seq_end,
            next_segment: d.body.segment + 1,
            next_digest: d.body.digest_seq + 1,
            prev_sha256: Some(hex(&Sha256::digest(&bytes))),
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
        key: &SigningKey,
    ) -> Self {
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
        };
        let signature = hex(&key.sign(&canonical(&body)).to_bytes());
        Self { body, signature }
    }

    /// Write durably (temp, fsync, rename, fsync dir) and return the new chain head.
    pub fn write(&self, root: &Path) -> Result<ChainHead, String> {
        let dir = digest_dir(root, self.body.node);
        fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| e.to_string())?;
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
        res.map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(ChainHead {
            next_seq: self.body.seq_end,
            next_segment: self.body.segment + 1,
            next_digest: self.body.digest_seq + 1,
            prev_sha256: Some(hex(&Sha256::digest(&bytes))),
            prev_signature: Some(self.signature.clone()),
        })
    }
}

/// A new random signing key (from the OS).
pub fn generate_key() -> std::io::Result<SigningKey> {
    let mut seed = [0u8; 32];
    fs::File::open("/dev/urandom")?.read_exact(&mut seed)?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Write `key` (hex seed, mode 0600) to `path` and its public key to `path.pub`.
pub fn write_key(key: &SigningKey, path: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    std::io::Write::write_all(&mut f, hex(&key.to_bytes()).as_bytes())?;
    f.sync_all()?;
    let pub_path = path.with_extension("pub");
    fs::write(&pub_path, hex(key.verifying_key().as_bytes()))?;
    Ok(pub_path)
}

pub fn read_signing_key(path: &Path) -> Result<SigningKey, String> {
    let s = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let b: [u8; 32] = unhex(s.trim())
        .and_then(|v| v.try_into().ok())
        .ok_or_else(|| format!("{}: not a hex Ed25519 seed", path.display()))?;
    Ok(SigningKey::from_bytes(&b))
}

pub fn read_verifying_key(path: &Path) -> Result<VerifyingKey, String> {
    let s = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let b: [u8; 32] = unhex(s.trim())
        .and_then(|v| v.try_into().ok())
        .ok_or_else(|| format!("{}: not a hex Ed25519 public key", path.display()))?;
    VerifyingKey::from_bytes(&b).map_err(|e| format!("{}: {e}", path.display()))
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
}

impl Report {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
}

/// Verify every node's digest chain under `root` (optionally only digests sealed in
/// `[from_ns, to_ns)`), checking signatures against `key` when given (else against the key the
/// first digest of each node names — trust on first use, reported by the CLI).
pub fn verify(
    root: &Path,
    key: Option<&VerifyingKey>,
    from_ns: Option<i64>,
    to_ns: Option<i64>,
) -> Report {
    let mut r = Report::default();
    let mut named: BTreeMap<PathBuf, (String, u64)> = BTreeMap::new();

    let mut in_range_files: BTreeSet<PathBuf> = BTreeSet::new();
    let digests_root = root.join("_digests");
    let mut nodes: Vec<PathBuf> = fs::read_dir(&digests_root)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    nodes.sort();
    for node_dir in nodes {
        let node: u32 = node_dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("node="))
            .and_then(|n| n.parse().ok())
            .unwrap_or(u32::MAX);
        let mut files: Vec<PathBuf> = fs::read_dir(&node_dir)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.retain(|p| p.extension().is_some_and(|x| x == "json"));
        files.sort();
        let mut prev: Option<(String, String, u64, u64)> = None; // (sha, signature, digest_seq, seq_end)
        let mut node_key: Option<VerifyingKey> = key.copied();
        for path in files {
            let bytes = match fs::read(&path) {
                Ok(b) => b,
                Err(e) => {
                    r.problems.push(Problem::DigestUnreadable {
                        digest: path,
                        why: e.to_string(),
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
            let mut ok = true;
            // Signature.
            let vk = match node_key {
                Some(k) => Some(k),
                None => unhex(&d.body.public_key)
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .and_then(|b| VerifyingKey::from_bytes(&b).ok()),
            };
            node_key = node_key.or(vk);
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
            } else if let Some(k) = key
                && hex(k.as_bytes()) != d.body.public_key
            {
                r.problems.push(Problem::WrongKey {
                    digest: path.clone(),
                    key: d.body.public_key.clone(),
                });
                ok = false;
            }
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
                let p = root.join(&f.path);
                named.insert(p.clone(), (f.sha256.clone(), f.bytes));
                if in_range {
                    in_range_files.insert(p);
                }
            }
            if ok && in_range {
                r.valid_digests += 1;
            }
            prev = Some((sha, d.signature.clone(), d.body.digest_seq, d.body.seq_end));
        }
    }
    // Files: every named file must be intact; every sealed file must be named.
    let mut actual_sha: BTreeMap<PathBuf, (String, u64)> = BTreeMap::new();
    let mut all = Vec::new();
    walk(root, &mut all);
    for p in &all {
        if p.extension().is_some_and(|x| x == "parquet")
            && let Ok(s) = sha256_file(p)
        {
            actual_sha.insert(p.clone(), s);
        }
    }
    let by_sha_all: BTreeMap<String, PathBuf> = named
        .iter()
        .map(|(p, (s, _))| (s.clone(), p.clone()))
        .collect();
    for p in &in_range_files {
        let (sha, bytes) = &named[p];
        match actual_sha.get(p) {
            None => r.problems.push(Problem::FileMissing { path: p.clone() }),
            Some((s, _)) if s == sha => {
                r.valid_files += 1;
                r.verified_files.push(p.clone());
            }
            Some((s, n)) => {
                if let Some(orig) = by_sha_all.get(s).filter(|o| *o != p) {
                    r.problems.push(Problem::FileReordered {
                        path: p.clone(),
                        holds_content_of: orig.clone(),
                    });
                } else if n < bytes {
                    r.problems.push(Problem::FileTruncated {
                        path: p.clone(),
                        sealed_bytes: *bytes,
                        found_bytes: *n,
                    });
                } else {
                    r.problems.push(Problem::FileModified { path: p.clone() });
                }
            }
        }
    }
    for p in actual_sha.keys() {
        if !named.contains_key(p) {
            r.problems.push(Problem::FileExtra { path: p.clone() });
        }
    }
    r.live_segments = all
        .into_iter()
        .filter(|p| p.extension().is_some_and(|x| x == "arrows"))
        .collect();
    r
}

//! Signed checkpoints: what a hash chain cannot say about its own tail.
//!
//! A digest chain proves that nothing *inside* it was changed, but not that it was not cut: an
//! attacker who deletes a node's newest digest together with every file it names leaves a
//! shorter chain that verifies. Certificate Transparency answers with signed tree heads that
//! others keep; CloudTrail with a digest every hour, idle or not, whose sequence the validator
//! expects. A checkpoint is the same statement for one node: *"my newest digest is `digest_seq`,
//! whose file hashes to `digest_sha256`, and the chain accounts for events up to `seq_end`"*,
//! signed with the node's audit key and published on a schedule (also when idle) to places the
//! node's own storage cannot rewrite ([`CheckpointSink`]: another directory or mount, another
//! node's log, stdout for a log collector, an object-store prefix).
//!
//! `verify` then holds the chain against the newest checkpoint it can find or is given: a chain
//! that ends before the checkpoint's digest is a cut tail; a digest whose file differs from the
//! checkpoint's hash is a rewritten (forked) chain; a node without fresh evidence is stale.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::digest::{ChainHead, hex, unhex};
use crate::{AuditSink, Event};

pub const CHECKPOINT_FORMAT: &str = "custody-audit-checkpoint-1";

/// The prefix of a checkpoint printed as a log line ([`StdoutSink`]); readers accept lines with
/// or without it.
pub const LOG_LINE_PREFIX: &str = "custody-checkpoint ";

/// The `node_events` kind of a checkpoint recorded in another node's log ([`LogSink`]).
pub const NODE_EVENT_KIND: &str = "checkpoint";

/// The signed part of a checkpoint (field order is the canonical order).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct CheckpointBody {
    pub format: String,
    pub node: u32,
    /// The node's newest digest when the checkpoint was issued (`None` before its first seal).
    pub digest_seq: Option<u64>,
    /// SHA-256 of that digest's file.
    pub digest_sha256: Option<String>,
    /// Node sequence numbers below this are accounted for by the chain.
    pub seq_end: u64,
    pub issued_wall_ns: i64,
    pub public_key: String,
}

/// A signed checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Checkpoint {
    #[serde(flatten)]
    pub body: CheckpointBody,
    pub signature: String,
}

/// Why a checkpoint does not vouch for anything.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    #[error("not a checkpoint: {0}")]
    Parse(String),
    #[error("checkpoint of node {node}: unknown format {format:?}")]
    Format { node: u32, format: String },
    #[error("checkpoint of node {node}: INVALID signature")]
    BadSignature { node: u32 },
    #[error("checkpoint of node {node} is signed by an unexpected key {key}")]
    WrongKey { node: u32, key: String },
}

fn canonical(body: &CheckpointBody) -> Vec<u8> {
    // serde_json writes struct fields in declaration order: deterministic bytes.
    serde_json::to_vec(body).unwrap_or_default()
}

impl Checkpoint {
    /// Sign the state of `head` (the node's chain after its newest seal) at `issued_wall_ns`.
    pub fn sign(head: &ChainHead, node: u32, issued_wall_ns: i64, key: &SigningKey) -> Self {
        let body = CheckpointBody {
            format: CHECKPOINT_FORMAT.to_owned(),
            node,
            digest_seq: head
                .prev_sha256
                .as_ref()
                .map(|_| head.next_digest.saturating_sub(1)),
            digest_sha256: head.prev_sha256.clone(),
            seq_end: head.next_seq,
            issued_wall_ns,
            public_key: hex(key.verifying_key().as_bytes()),
        };
        let signature = hex(&key.sign(&canonical(&body)).to_bytes());
        Self { body, signature }
    }

    /// Check the signature — against `key` when given, else against the key the checkpoint
    /// names (which the caller must then trust some other way).
    pub fn verify(&self, key: Option<&VerifyingKey>) -> Result<(), CheckpointError> {
        let node = self.body.node;
        if self.body.format != CHECKPOINT_FORMAT {
            return Err(CheckpointError::Format {
                node,
                format: self.body.format.clone(),
            });
        }
        if let Some(k) = key
            && hex(k.as_bytes()) != self.body.public_key
        {
            return Err(CheckpointError::WrongKey {
                node,
                key: self.body.public_key.clone(),
            });
        }
        let named = unhex32(&self.body.public_key).and_then(|b| VerifyingKey::from_bytes(&b).ok());
        let sig = unhex_sig(&self.signature);
        match (key.copied().or(named), sig) {
            (Some(vk), Some(sig)) if vk.verify(&canonical(&self.body), &sig).is_ok() => Ok(()),
            _ => Err(CheckpointError::BadSignature { node }),
        }
    }

    /// The checkpoint as one JSON line (no prefix).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// One checkpoint from JSON (a file a [`DirSink`] wrote, or one line, prefixed or not).
    pub fn parse(text: &str) -> Result<Self, CheckpointError> {
        let t = text.trim();
        let t = t.strip_prefix(LOG_LINE_PREFIX).unwrap_or(t);
        serde_json::from_str(t).map_err(|e| CheckpointError::Parse(e.to_string()))
    }

    /// Every checkpoint in `text`: a checkpoint file, or a log of lines of which those that
    /// carry a checkpoint (with [`LOG_LINE_PREFIX`], or a JSON object of this format) count and
    /// the others (a log collector's other lines) are skipped.
    pub fn parse_all(text: &str) -> Vec<Result<Self, CheckpointError>> {
        if let Ok(one) = Self::parse(text) {
            return vec![Ok(one)];
        }
        text.lines()
            .filter_map(|line| {
                let t = line.trim();
                // Anywhere in the line: a collector may prefix its own fields, and a process
                // that streams text to stdout may not have ended its line yet.
                if let Some(at) = t.find(LOG_LINE_PREFIX) {
                    return Some(Self::parse(&t[at + LOG_LINE_PREFIX.len()..]));
                }
                (t.starts_with('{') && t.contains(CHECKPOINT_FORMAT)).then(|| Self::parse(t))
            })
            .collect()
    }
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    unhex(s)?.try_into().ok()
}

fn unhex_sig(s: &str) -> Option<Signature> {
    let b: [u8; 64] = unhex(s)?.try_into().ok()?;
    Some(Signature::from_bytes(&b))
}

/// Why a checkpoint could not be published (the writer logs it and records it in its own log;
/// the audit log itself goes on).
#[derive(Debug, thiserror::Error)]
#[error("publishing a checkpoint to {place}: {why}")]
pub struct PublishError {
    pub place: String,
    pub why: String,
}

/// A place a node's checkpoints go to, outside what the node's own storage can rewrite.
pub trait CheckpointSink: Send + Sync + std::fmt::Debug {
    fn publish(&self, cp: &Checkpoint) -> Result<(), PublishError>;
}

/// A directory (another disk or mount, a peer's volume): the node's newest checkpoint as
/// `<dir>/node=<n>.json`, replaced atomically (temp, fsync, rename, fsync dir). The writer
/// keeps one under its own root too (`<root>/_checkpoints/`), which an attacker with the node's
/// disk can delete — the others are the ones that count.
#[derive(Clone, Debug)]
pub struct DirSink {
    dir: PathBuf,
}

impl DirSink {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Where node `node`'s checkpoint goes under `dir`.
    pub fn path(dir: &Path, node: u32) -> PathBuf {
        dir.join(format!("node={node}.json"))
    }
}

impl CheckpointSink for DirSink {
    fn publish(&self, cp: &Checkpoint) -> Result<(), PublishError> {
        let path = Self::path(&self.dir, cp.body.node);
        let tmp = self.dir.join(format!(".node={}.json.tmp", cp.body.node));
        let res: std::io::Result<()> = (|| {
            std::fs::create_dir_all(&self.dir)?;
            let mut f = std::fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut f, cp.to_json().as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(&self.dir)?.sync_all()
        })();
        res.map_err(|e| PublishError {
            place: path.display().to_string(),
            why: e.to_string(),
        })
    }
}

/// Standard output, one line per checkpoint (`custody-checkpoint {json}`), for a log collector
/// that ships the node's output elsewhere.
#[derive(Clone, Copy, Debug, Default)]
pub struct StdoutSink;

impl CheckpointSink for StdoutSink {
    fn publish(&self, cp: &Checkpoint) -> Result<(), PublishError> {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{LOG_LINE_PREFIX}{}", cp.to_json())
            .and_then(|()| out.flush())
            .map_err(|e| PublishError {
                place: "stdout".into(),
                why: e.to_string(),
            })
    }
}

/// The newest checkpoint its writer published, kept in memory for whoever hands it on (a pair's
/// peer exchange sends it to the other node, which keeps it in its own log).
#[derive(Debug, Default)]
pub struct Latest(std::sync::Mutex<Option<Checkpoint>>);

impl Latest {
    pub fn get(&self) -> Option<Checkpoint> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl CheckpointSink for Latest {
    fn publish(&self, cp: &Checkpoint) -> Result<(), PublishError> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(cp.clone());
        Ok(())
    }
}

/// Keeps in a log the checkpoints another node hands over (a pair's peer exchange): each
/// checkpoint of a node newer than the last one kept of that node becomes a row as [`LogSink`]
/// writes it. What is kept is not trusted: `verify` checks each against the node's key.
#[derive(Debug)]
pub struct Keeper {
    log: LogSink,
    newest: std::collections::BTreeMap<u32, i64>,
}

impl Keeper {
    pub fn new(log: Arc<dyn AuditSink>, name: impl Into<String>) -> Self {
        Self {
            log: LogSink::new(log, name),
            newest: std::collections::BTreeMap::new(),
        }
    }

    /// Keep `cp` if it is newer than the last of its node; returns whether it was recorded.
    pub fn keep(&mut self, cp: &Checkpoint) -> Result<bool, PublishError> {
        let node = cp.body.node;
        if self
            .newest
            .get(&node)
            .is_some_and(|&t| t >= cp.body.issued_wall_ns)
        {
            return Ok(false);
        }
        self.log.publish(cp)?;
        self.newest.insert(node, cp.body.issued_wall_ns);
        Ok(true)
    }
}

/// A node's side of a pair's checkpoint exchange ([`crate::CheckpointExchange`]): its own
/// newest checkpoint (a [`Latest`] among its writer's sinks) to send, and a [`Keeper`] into its
/// own log for the peer's. A checkpoint that claims this node is refused.
#[derive(Debug)]
pub struct PeerExchange {
    own: Arc<Latest>,
    keeper: std::sync::Mutex<Keeper>,
    own_node: u32,
}

impl PeerExchange {
    /// `peer` names the other node (in errors).
    pub fn new(own: Arc<Latest>, log: Arc<dyn AuditSink>, own_node: u32, peer: &str) -> Self {
        Self {
            own,
            keeper: std::sync::Mutex::new(Keeper::new(log, format!("{peer} checkpoints"))),
            own_node,
        }
    }
}

impl crate::CheckpointExchange for PeerExchange {
    fn own(&self) -> Option<String> {
        self.own.get().map(|cp| cp.to_json())
    }

    fn keep(&self, json: &str) -> Result<bool, crate::ExchangeRefused> {
        let cp = Checkpoint::parse(json)
            .map_err(|e| crate::ExchangeRefused::Malformed(e.to_string()))?;
        if cp.body.node == self.own_node {
            return Err(crate::ExchangeRefused::OwnNode(cp.body.node));
        }
        let mut keeper = self.keeper.lock().unwrap_or_else(|p| p.into_inner());
        keeper
            .keep(&cp)
            .map_err(|e| crate::ExchangeRefused::Log(e.to_string()))
    }
}

/// Another log — a peer node's, the eBPF witness's: each checkpoint recorded there as a
/// `node_events` row (kind [`NODE_EVENT_KIND`], detail the checkpoint's JSON), sealed and
/// signed under *that* log's key. `verify` finds them in the root's verified files.
#[derive(Clone, Debug)]
pub struct LogSink {
    log: Arc<dyn AuditSink>,
    name: String,
}

impl LogSink {
    /// `name` says whose log it is (in errors).
    pub fn new(log: Arc<dyn AuditSink>, name: impl Into<String>) -> Self {
        Self {
            log,
            name: name.into(),
        }
    }
}

impl CheckpointSink for LogSink {
    fn publish(&self, cp: &Checkpoint) -> Result<(), PublishError> {
        self.log
            .record(Event::Node {
                ts_ns: crate::mono_now_ns(),
                kind: NODE_EVENT_KIND.into(),
                detail: cp.to_json(),
            })
            .map_err(|e| PublishError {
                place: self.name.clone(),
                why: e.to_string(),
            })
    }
}

/// Keeps, in another log, the checkpoints a node publishes into a directory: what a peer node
/// or the eBPF witness (`custody probe --checkpoints-from`) runs when the node is another
/// process — on this host, or on a shared mount. Each new checkpoint (newer `issued_wall_ns`
/// than the last relayed one of its node) becomes a `node_events` row [`NODE_EVENT_KIND`] in
/// `log`, sealed under that log's key; unreadable or foreign files are skipped (the verifier
/// checks every relayed checkpoint's signature against the node's key).
#[derive(Debug)]
pub struct Relay {
    dir: PathBuf,
    keeper: Keeper,
}

/// Most checkpoint files one [`Relay::poll`] reads (one per node: a directory with more is not a
/// checkpoint place).
const RELAY_MAX_FILES: usize = 4096;

impl Relay {
    pub fn new(dir: impl Into<PathBuf>, log: Arc<dyn AuditSink>) -> Self {
        let dir = dir.into();
        let keeper = Keeper::new(log, dir.display().to_string());
        Self { dir, keeper }
    }

    /// Relay what is new in the directory; returns how many checkpoints were recorded. A missing
    /// directory is nothing new; a log that refuses the event is an error (the relay stops).
    pub fn poll(&mut self) -> Result<usize, PublishError> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Ok(0);
        };
        let mut n = 0;
        for e in entries.flatten().take(RELAY_MAX_FILES) {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if !(name.starts_with("node=") && name.ends_with(".json")) {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            let Ok(cp) = Checkpoint::parse(&text) else {
                continue;
            };
            n += usize::from(self.keeper.keep(&cp)?);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(digests: u64) -> ChainHead {
        ChainHead {
            next_seq: 10 * digests,
            next_segment: digests,
            next_digest: digests,
            prev_sha256: (digests > 0).then(|| "ab".repeat(32)),
            prev_signature: None,
            tree: None,
        }
    }

    #[test]
    fn signed_checkpoints_verify_and_any_change_breaks_them() {
        let key = crate::digest::generate_key().expect("key");
        let cp = Checkpoint::sign(&head(3), 4, 1_000, &key);
        assert_eq!(cp.body.digest_seq, Some(2));
        assert_eq!(cp.body.seq_end, 30);
        cp.verify(Some(&key.verifying_key())).expect("valid");
        cp.verify(None).expect("valid under its own key");
        let mut cut = cp.clone();
        cut.body.digest_seq = Some(1);
        assert_eq!(
            cut.verify(None),
            Err(CheckpointError::BadSignature { node: 4 })
        );
        let other = crate::digest::generate_key().expect("key");
        assert!(matches!(
            cp.verify(Some(&other.verifying_key())),
            Err(CheckpointError::WrongKey { node: 4, .. })
        ));
        let fresh = Checkpoint::sign(&head(0), 4, 1_000, &key);
        assert_eq!(
            (fresh.body.digest_seq, fresh.body.digest_sha256),
            (None, None)
        );
    }

    #[test]
    fn checkpoints_are_found_in_a_file_and_in_a_collectors_log() {
        let key = crate::digest::generate_key().expect("key");
        let a = Checkpoint::sign(&head(1), 1, 5, &key);
        let b = Checkpoint::sign(&head(2), 1, 9, &key);
        assert_eq!(Checkpoint::parse_all(&a.to_json()), vec![Ok(a.clone())]);
        let log = format!(
            "INFO something else\n{LOG_LINE_PREFIX}{}\nWARN {{\"not\": 1}}\n{}\n",
            a.to_json(),
            b.to_json()
        );
        assert_eq!(Checkpoint::parse_all(&log), vec![Ok(a), Ok(b)]);
        assert!(Checkpoint::parse_all("no checkpoint here").is_empty());
    }

    #[test]
    fn a_dir_sink_keeps_the_newest_checkpoint() {
        let dir = std::env::temp_dir().join(format!("custody-cp-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let key = crate::digest::generate_key().expect("key");
        let sink = DirSink::new(&dir);
        for n in 1..=3 {
            sink.publish(&Checkpoint::sign(&head(n), 2, n as i64, &key))
                .expect("publish");
        }
        let text = std::fs::read_to_string(DirSink::path(&dir, 2)).expect("read");
        let cp = Checkpoint::parse(&text).expect("parse");
        assert_eq!(cp.body.digest_seq, Some(2));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

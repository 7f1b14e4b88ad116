//! Per-tenant incident notices (issue 40): what the forensics found a tenant's responses could
//! have read of other tenants' data, and what other tenants' responses could have read of its
//! own — each claim with the receipt (inclusion proofs to the node's cosigned checkpoint) of the
//! tenant's own records it rests on — and, for every node of the log, the window's consistency
//! proof (the tree at the window's start is a prefix of the one at its end). A tenant with no
//! exposure gets the same notice with nothing listed: a statement of non-exposure over that
//! window, checkable the same way. A notice names no other tenant and carries no other tenant's
//! record: only counts, and the tenant's own records.
//!
//! Files (`custody forensics notify ROOT --out DIR --key K`): `DIR/<tenant>.notice.json` (the
//! notice) and `DIR/<tenant>.notice.sig`, a C2SP signed note by the notice key whose text is
//!
//! ```text
//! custody.notice/1
//! <tenant>
//! <base64 SHA-256 of the notice file's bytes>
//! ```
//!
//! and `DIR/notices.vkey`, the notice key's verifier key. `docs/forensics.md` (*Notices*) says
//! what each field means.

use std::collections::{BTreeMap, BTreeSet};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use ed25519_dalek::VerifyingKey;
use serde_json::{Value, json};
use sha2::Digest as _;

use crate::digest::LogStore;
use crate::tlog::{self, ConsistencyProof, NoteSigner, TlogError};
use crate::tree_store::{self, NodeLog, ReceiptStatus, WitnessPolicy};

/// The notice's `format`.
pub const NOTICE_FORMAT: &str = "custody-notice/1";
/// The first line of a notice signature's text.
pub const NOTICE_SIG_FORMAT: &str = "custody.notice/1";
/// Requests a notice lists on each side at most (a tenant with more gets the first ones and
/// `truncated`); each costs a receipt.
pub const MAX_NOTICE_REQUESTS: usize = 4096;

/// One row of the exposure answer per writing request (`EXPOSURE_SOURCES_SQL`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourcedExposure {
    pub node: u32,
    /// The response that could have read another tenant's data.
    pub request: u64,
    pub recipient_tenant: String,
    pub source_tenant: String,
    /// The source tenant's request that wrote the slots.
    pub source_request: u64,
    pub foreign_slots: u64,
    pub first_wall_ns: i64,
    pub last_wall_ns: i64,
    pub unchecked: bool,
}

/// What the notices cover.
#[derive(Debug, Clone)]
pub struct NoticeScope {
    /// Every tenant with a request in the window: each gets a notice.
    pub tenants: BTreeSet<String>,
    pub from_wall_ns: i64,
    pub to_wall_ns: i64,
    /// Every node whose log the forensics read.
    pub nodes: Vec<u32>,
}

/// A notice, ready to write.
#[derive(Debug, Clone)]
pub struct Notice {
    pub tenant: String,
    /// `<tenant>.notice.json`'s bytes.
    pub json: Vec<u8>,
    /// `<tenant>.notice.sig`'s bytes (a signed note).
    pub sig: Vec<u8>,
    pub exposed: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum NoticeError {
    #[error("node {node}'s log: {source}")]
    Log {
        node: u32,
        source: tree_store::ProofError,
    },
    #[error("a receipt: {0}")]
    Receipt(#[from] tree_store::ReceiptError),
    #[error(transparent)]
    Tlog(#[from] TlogError),
    #[error("tenant id {0:?} cannot name a notice (one word, no '/')")]
    BadTenant(String),
    #[error("not a {NOTICE_FORMAT} notice: {0}")]
    Malformed(String),
    #[error("the notice's signature: {0}")]
    Signature(String),
}

fn malformed(why: impl Into<String>) -> NoticeError {
    NoticeError::Malformed(why.into())
}

/// A request a notice lists, and the facts about it.
#[derive(Debug, Default)]
struct Listed {
    foreign_slots: u64,
    first_wall_ns: i64,
    last_wall_ns: i64,
    unchecked: bool,
    /// The other side's requests (counted, never named).
    others: BTreeSet<(u32, u64)>,
}

impl Listed {
    fn add(&mut self, r: &SourcedExposure, other: (u32, u64)) {
        if self.others.is_empty() && self.foreign_slots == 0 {
            self.first_wall_ns = r.first_wall_ns;
            self.last_wall_ns = r.last_wall_ns;
        }
        self.foreign_slots += r.foreign_slots;
        self.first_wall_ns = self.first_wall_ns.min(r.first_wall_ns);
        self.last_wall_ns = self.last_wall_ns.max(r.last_wall_ns);
        self.unchecked |= r.unchecked;
        self.others.insert(other);
    }
}

/// Builds every tenant's notice from the exposure rows, each signed by `signer`.
pub fn build_notices(
    store: &dyn LogStore,
    rows: &[SourcedExposure],
    scope: &NoticeScope,
    signer: &NoteSigner,
    issued_wall_ns: i64,
) -> Result<Vec<Notice>, NoticeError> {
    let logs = window_logs(store, scope)?;
    // One open log per node for every receipt: the leaves a proof recomputes are kept.
    let mut open = BTreeMap::new();
    for &node in &scope.nodes {
        let log = NodeLog::open(store, node).map_err(|source| NoticeError::Log { node, source })?;
        open.insert(node, log);
    }
    let mut out = Vec::with_capacity(scope.tenants.len());
    for tenant in &scope.tenants {
        if tenant.is_empty() || tenant.contains(['/', '\\', '\n', ' ']) || tenant.starts_with('.') {
            return Err(NoticeError::BadTenant(tenant.clone()));
        }
        let mut read: BTreeMap<(u32, u64), Listed> = BTreeMap::new();
        let mut written: BTreeMap<(u32, u64), Listed> = BTreeMap::new();
        for r in rows {
            if r.recipient_tenant == *tenant {
                read.entry((r.node, r.request))
                    .or_default()
                    .add(r, (r.node, r.source_request));
            }
            if r.source_tenant == *tenant {
                written
                    .entry((r.node, r.source_request))
                    .or_default()
                    .add(r, (r.node, r.request));
            }
        }
        let exposed = !read.is_empty() || !written.is_empty();
        let notice = json!({
            "format": NOTICE_FORMAT,
            "tenant": tenant,
            "issued_wall_ns": issued_wall_ns,
            "window": {"from_wall_ns": scope.from_wall_ns, "to_wall_ns": scope.to_wall_ns},
            "exposed": exposed,
            "summary": summary(tenant, &read, &written),
            "as_recipient": listed(store, &open, tenant, &read, "source_requests")?,
            "as_source": listed(store, &open, tenant, &written, "responses")?,
            "truncated": read.len() > MAX_NOTICE_REQUESTS || written.len() > MAX_NOTICE_REQUESTS,
            "logs": logs,
        });
        let json = serde_json::to_vec_pretty(&notice).map_err(|e| malformed(e.to_string()))?;
        let sig = sign(signer, tenant, &json)?;
        out.push(Notice {
            tenant: tenant.clone(),
            json,
            sig,
            exposed,
        });
    }
    Ok(out)
}

fn summary(
    tenant: &str,
    read: &BTreeMap<(u32, u64), Listed>,
    written: &BTreeMap<(u32, u64), Listed>,
) -> String {
    if read.is_empty() && written.is_empty() {
        return format!(
            "No response of {tenant} in the window could have read another tenant's data, and no other tenant's response could have read {tenant}'s, per these nodes' logs between the tree heads listed."
        );
    }
    let slots = |m: &BTreeMap<(u32, u64), Listed>| m.values().map(|l| l.foreign_slots).sum::<u64>();
    let others = |m: &BTreeMap<(u32, u64), Listed>| {
        m.values()
            .flat_map(|l| l.others.iter())
            .collect::<BTreeSet<_>>()
            .len()
    };
    format!(
        "{} response(s) of {tenant} could have read up to {} KV slot(s) written by {} request(s) of other tenants; {} request(s) of {tenant} wrote up to {} slot(s) that {} response(s) of other tenants could have read.",
        read.len(),
        slots(read),
        others(read),
        written.len(),
        slots(written),
        others(written)
    )
}

/// The notice's entries of one side: each request with its counts and its receipt.
fn listed(
    store: &dyn LogStore,
    open: &BTreeMap<u32, NodeLog<'_>>,
    tenant: &str,
    m: &BTreeMap<(u32, u64), Listed>,
    others_name: &str,
) -> Result<Vec<Value>, NoticeError> {
    let mut out = Vec::with_capacity(m.len().min(MAX_NOTICE_REQUESTS));
    for (&(node, request), l) in m.iter().take(MAX_NOTICE_REQUESTS) {
        let mut v = json!({
            "node": node,
            "request_id": format!("req-{node}-{request}"),
            "foreign_slots": l.foreign_slots,
            "first_wall_ns": l.first_wall_ns,
            "last_wall_ns": l.last_wall_ns,
            "unchecked": l.unchecked,
            others_name: l.others.len(),
        });
        let found = match open.get(&node) {
            Some(log) => tree_store::receipt_from(log, 0, None, tenant, request),
            None => tree_store::request_receipt(store, node, 0, tenant, request),
        }
        .map_err(|source| NoticeError::Log { node, source })?;
        match found {
            ReceiptStatus::Ready(r) => {
                v["receipt"] = serde_json::from_slice(&r).map_err(|e| malformed(e.to_string()))?;
            }
            ReceiptStatus::Pending => {
                v["receipt_missing"] = "its records are not all sealed and checkpointed yet".into();
            }
            ReceiptStatus::Unknown => {
                v["receipt_missing"] = "its records are not in this incarnation's log".into();
            }
        }
        out.push(v);
    }
    Ok(out)
}

/// Each node's window: the tree at the window's start (the newest sealed by then), the
/// (cosigned) checkpoint now, and the consistency proof between them.
fn window_logs(store: &dyn LogStore, scope: &NoticeScope) -> Result<Vec<Value>, NoticeError> {
    let mut out = Vec::with_capacity(scope.nodes.len());
    for &node in &scope.nodes {
        let err = |source| NoticeError::Log { node, source };
        let log = NodeLog::open(store, node).map_err(err)?;
        let newest = log.checkpoint_note().map_err(err)?;
        let size = tlog::note_checkpoint(&newest)?.size();
        let note = log
            .cosigned_or_newest(size.saturating_sub(1))
            .map_err(err)?;
        let cp = tlog::note_checkpoint(&note)?;
        let old = log.size_sealed_by(scope.from_wall_ns).min(cp.size());
        let hashes = if old == 0 || old == cp.size() {
            Vec::new()
        } else {
            log.prove_consistency(old, cp.size()).map_err(err)?
        };
        let old_root = if old == 0 {
            Value::Null
        } else {
            B64.encode(log.root_at(old).map_err(err)?.0).into()
        };
        let proof = ConsistencyProof {
            old,
            hashes,
            checkpoint: note.clone(),
        };
        out.push(json!({
            "node": node,
            "origin": cp.origin(),
            "old_size": old,
            "old_root": old_root,
            "tree_size": cp.size(),
            "consistency": String::from_utf8_lossy(&proof.to_bytes()),
        }));
    }
    Ok(out)
}

fn sha256_b64(bytes: &[u8]) -> String {
    B64.encode(sha2::Sha256::digest(bytes))
}

fn sign(signer: &NoteSigner, tenant: &str, json: &[u8]) -> Result<Vec<u8>, NoticeError> {
    let text = format!("{NOTICE_SIG_FORMAT}\n{tenant}\n{}\n", sha256_b64(json));
    let mut note = signed_note::Note::new(text.as_bytes(), &[]).map_err(TlogError::from)?;
    note.add_sigs(&[signer]).map_err(TlogError::from)?;
    Ok(note.to_bytes())
}

/// A notice that checked.
#[derive(Debug, Clone)]
pub struct CheckedNotice {
    pub tenant: String,
    pub exposed: bool,
    pub summary: String,
    /// Receipts checked (both sides).
    pub receipts: usize,
    /// Listed requests without a receipt (not sealed yet), by request id.
    pub without_receipt: Vec<String>,
    /// Per node: (node, old size, tree size) the window's consistency proof links.
    pub windows: Vec<(u32, u64, u64)>,
}

/// Checks a notice offline: signed by `notice_vkey` over exactly these bytes for its tenant;
/// every receipt it carries (its tenant's, for the request it lists, each proof to its node's
/// checkpoint signed by `node_key`, with `witnesses`' cosignatures when given); every node's
/// window (the old tree a prefix of the checkpoint's, signed by the node).
pub fn verify_notice(
    json: &[u8],
    sig: &[u8],
    notice_vkey: &str,
    node_key: &VerifyingKey,
    witnesses: Option<&WitnessPolicy>,
) -> Result<CheckedNotice, NoticeError> {
    let v: Value = serde_json::from_slice(json).map_err(|e| malformed(e.to_string()))?;
    if v["format"] != NOTICE_FORMAT {
        return Err(malformed("format"));
    }
    let tenant = v["tenant"].as_str().ok_or_else(|| malformed("tenant"))?;
    check_signature(sig, notice_vkey, tenant, json)?;
    let mut checked = CheckedNotice {
        tenant: tenant.to_owned(),
        exposed: v["exposed"].as_bool().ok_or_else(|| malformed("exposed"))?,
        summary: v["summary"].as_str().unwrap_or_default().to_owned(),
        receipts: 0,
        without_receipt: Vec::new(),
        windows: Vec::new(),
    };
    let mut listed = 0;
    for side in ["as_recipient", "as_source"] {
        for e in v[side].as_array().ok_or_else(|| malformed(side))? {
            listed += 1;
            let rid = e["request_id"]
                .as_str()
                .ok_or_else(|| malformed("request_id"))?;
            if e["receipt"].is_null() {
                checked.without_receipt.push(rid.to_owned());
                continue;
            }
            let bytes = serde_json::to_vec(&e["receipt"]).map_err(|e| malformed(e.to_string()))?;
            let r = tree_store::verify_receipt(&bytes, node_key, witnesses)?;
            if r.tenant != tenant || r.request_id != rid {
                return Err(malformed(format!(
                    "{side}: the receipt of {} of {} is listed as {rid} of {tenant}",
                    r.request_id, r.tenant
                )));
            }
            checked.receipts += 1;
        }
    }
    if checked.exposed != (listed > 0) {
        return Err(malformed("`exposed` disagrees with what is listed"));
    }
    for l in v["logs"].as_array().ok_or_else(|| malformed("logs"))? {
        checked.windows.push(check_window(l, node_key, witnesses)?);
    }
    Ok(checked)
}

fn check_signature(sig: &[u8], vkey: &str, tenant: &str, json: &[u8]) -> Result<(), NoticeError> {
    let bad = |m: String| NoticeError::Signature(m);
    let verifier = signed_note::StandardVerifier::new(vkey).map_err(|e| bad(e.to_string()))?;
    let known = signed_note::VerifierList::new(vec![Box::new(verifier)]);
    let note = signed_note::Note::from_bytes(sig).map_err(|e| bad(e.to_string()))?;
    note.verify(&known).map_err(|e| bad(e.to_string()))?;
    let want = format!("{NOTICE_SIG_FORMAT}\n{tenant}\n{}\n", sha256_b64(json));
    if note.text() != want.as_bytes() {
        return Err(bad(
            "it signs another notice (its tenant or the notice's SHA-256 differ)".into(),
        ));
    }
    Ok(())
}

/// One node's window: its checkpoint signed by the node (and cosigned, per `witnesses`), and
/// the consistency proof from the old tree to it.
fn check_window(
    l: &Value,
    node_key: &VerifyingKey,
    witnesses: Option<&WitnessPolicy>,
) -> Result<(u32, u64, u64), NoticeError> {
    let node = l["node"].as_u64().ok_or_else(|| malformed("logs[].node"))? as u32;
    let origin = l["origin"]
        .as_str()
        .ok_or_else(|| malformed("logs[].origin"))?;
    let text = l["consistency"]
        .as_str()
        .ok_or_else(|| malformed("logs[].consistency"))?;
    let proof = ConsistencyProof::parse(text.as_bytes())?;
    let vkey = tlog::ed25519_vkey(origin, node_key);
    let cp = tlog::open_checkpoint(&proof.checkpoint, &vkey)?;
    if let Some(p) = witnesses {
        let got = crate::cosign::cosignatures(&proof.checkpoint, &p.vkeys)
            .map_err(|e| malformed(e.to_string()))?;
        if got.len() < p.min {
            return Err(malformed(format!(
                "node {node}: {} of the required {} witnesses cosigned its checkpoint",
                got.len(),
                p.min
            )));
        }
    }
    let old = proof.old;
    if old > 0 && old < cp.size() {
        let root: [u8; 32] = l["old_root"]
            .as_str()
            .and_then(|r| B64.decode(r).ok())
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| malformed("logs[].old_root"))?;
        let hashes: tlog_tiles::TreeProof = proof.hashes.clone();
        tlog::verify_consistency(&hashes, cp.size(), *cp.hash(), old, tlog::Hash(root))?;
    } else if old > cp.size() {
        return Err(malformed(format!(
            "node {node}: the old tree is larger than the new"
        )));
    }
    Ok((node, old, cp.size()))
}

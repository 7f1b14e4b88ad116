//! `custody receipt verify`: a tenant's receipt (`GET /v1/audit/receipt/{request_id}`) checked
//! offline (`custody_audit::tree_store::verify_receipt`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Subcommand;

use custody_audit::digest;
use custody_audit::tree_store::{self, WitnessPolicy};

#[derive(Subcommand, Debug)]
pub(crate) enum ReceiptCmd {
    /// Check a receipt offline: every record's inclusion proof to the node's signed checkpoint
    /// (and its witnesses' cosignatures), every record the receipt's tenant's and request's.
    /// Prints the records. Exit 1 if it does not hold.
    Verify {
        receipt: PathBuf,
        /// The node's public key (hex, `<key>.pub`).
        #[arg(long)]
        node_key: PathBuf,
        /// A tlog witness's cosignature verifier key; repeatable.
        #[arg(long = "witness-key")]
        witnesses: Vec<String>,
        /// How many of them must have cosigned (default: all given).
        #[arg(long, requires = "witnesses")]
        min_witnesses: Option<usize>,
        /// The signed promise the node gave in its answer: the answer's JSON (whole body, SSE
        /// chunk or its `custody_receipt` object) or the promise note itself. Every record it
        /// promised must be in the receipt, unchanged.
        #[arg(long)]
        promise: Option<PathBuf>,
    },
    /// Hold an answer's promises (`custody_receipt`) to the live log: for each promised record,
    /// its inclusion proof (hashes only, `GET /v1/audit/proof/inclusion`) from the node — or,
    /// through a front or router, from the node of each entry — checked against the promised
    /// leaf and the node's signed checkpoint. Works where the node no longer serves the receipt
    /// (a fork removed it). The API key is read from `CUSTODY_API_KEY`. Exit 1 if a promise is
    /// broken.
    CheckPromise {
        answer: PathBuf,
        /// The API's base URL (`http://host:port`).
        #[arg(long)]
        url: String,
        /// The nodes' public key (hex, `<key>.pub`).
        #[arg(long)]
        node_key: PathBuf,
        /// A tlog witness's cosignature verifier key; repeatable: each proof's checkpoint must
        /// be cosigned by all of them.
        #[arg(long = "witness-key")]
        witnesses: Vec<String>,
    },
    /// Check an incident notice (`custody forensics notify`) offline: its signature by the
    /// notice key over exactly its bytes, every receipt it carries (the tenant's own records,
    /// each proved to its node's checkpoint), every node's window consistency proof. Exit 1 if
    /// it does not hold.
    VerifyNotice {
        notice: PathBuf,
        /// Its signature (default: the notice's path with `.sig` for `.json`).
        #[arg(long)]
        sig: Option<PathBuf>,
        /// The notice key's verifier key (`notices.vkey`).
        #[arg(long)]
        notice_key: String,
        /// The nodes' public key (hex, `<key>.pub`).
        #[arg(long)]
        node_key: PathBuf,
        /// A tlog witness's cosignature verifier key; repeatable.
        #[arg(long = "witness-key")]
        witnesses: Vec<String>,
        /// How many of them must have cosigned (default: all given).
        #[arg(long, requires = "witnesses")]
        min_witnesses: Option<usize>,
    },
}

fn witness_policy(witnesses: Vec<String>, min: Option<usize>) -> Result<Option<WitnessPolicy>> {
    if witnesses.is_empty() {
        return Ok(None);
    }
    let min = min.unwrap_or(witnesses.len());
    if min == 0 || min > witnesses.len() {
        bail!(
            "--min-witnesses {min}: between 1 and the {} keys given",
            witnesses.len()
        );
    }
    Ok(Some(WitnessPolicy {
        vkeys: witnesses,
        min,
        checkpoints: Vec::new(),
    }))
}

/// `custody receipt verify-notice`.
fn verify_notice(
    notice: &std::path::Path,
    sig: Option<PathBuf>,
    notice_key: &str,
    node_key: &std::path::Path,
    policy: Option<WitnessPolicy>,
) -> Result<()> {
    let sig = sig.unwrap_or_else(|| notice.with_extension("sig"));
    let read =
        |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let (json, sig_bytes) = (read(notice)?, read(&sig)?);
    let key = digest::read_verifying_key(node_key).map_err(anyhow::Error::msg)?;
    match custody_audit::notice::verify_notice(
        &json,
        &sig_bytes,
        notice_key.trim(),
        &key,
        policy.as_ref(),
    ) {
        Ok(n) => {
            println!(
                "notice OK: tenant {}: {}",
                n.tenant,
                if n.exposed { "EXPOSED" } else { "not exposed" }
            );
            println!("  {}", n.summary);
            println!("  {} receipts of its own records checked", n.receipts);
            for rid in &n.without_receipt {
                println!("  {rid}: no receipt yet (not sealed when the notice was written)");
            }
            for (node, old, new) in &n.windows {
                if *old == 0 {
                    println!(
                        "  node {node}: its tree of {new} records (nothing was sealed before the window)"
                    );
                } else {
                    println!(
                        "  node {node}: its tree of {new} records extends the one of {old} (consistency proved)"
                    );
                }
            }
            Ok(())
        }
        Err(e) => {
            println!("notice FAILED: {e}");
            std::process::exit(1);
        }
    }
}

pub(crate) fn receipt_cmd(c: ReceiptCmd) -> Result<()> {
    match c {
        ReceiptCmd::VerifyNotice {
            notice,
            sig,
            notice_key,
            node_key,
            witnesses,
            min_witnesses,
        } => {
            let policy = witness_policy(witnesses, min_witnesses)?;
            verify_notice(&notice, sig, &notice_key, &node_key, policy)
        }
        ReceiptCmd::Verify {
            receipt,
            node_key,
            witnesses,
            min_witnesses,
            promise,
        } => verify(&receipt, &node_key, witnesses, min_witnesses, promise),
        ReceiptCmd::CheckPromise {
            answer,
            url,
            node_key,
            witnesses,
        } => check_promise_live(&answer, &url, &node_key, &witnesses),
    }
}

/// What one promised record's proof from the node says.
enum LeafVerdict {
    Kept { tree_size: u64 },
    Broken(String),
    Pending(String),
}

/// `custody receipt check-promise`.
fn check_promise_live(
    answer: &std::path::Path,
    url: &str,
    node_key: &std::path::Path,
    witnesses: &[String],
) -> Result<()> {
    let key = digest::read_verifying_key(node_key).map_err(anyhow::Error::msg)?;
    let api_key = std::env::var("CUSTODY_API_KEY")
        .context("CUSTODY_API_KEY: the tenant's API key (the proofs answer tenants only)")?;
    let mut broken = 0usize;
    for entry in answer_promises(answer)? {
        let rid = entry.request_id.clone().unwrap_or_default();
        let note = match entry.note {
            Ok(n) => n,
            Err(why) => {
                println!("{rid}: no promise in the answer ({why})");
                continue;
            }
        };
        let origin = custody_audit::promise::Promise::of_note(&note)
            .map_err(|e| anyhow::anyhow!("{rid}: {e}"))?
            .origin;
        let vkey = custody_audit::tlog::ed25519_vkey(&origin, &key);
        let p = custody_audit::promise::Promise::open(&note, &vkey)
            .map_err(|e| anyhow::anyhow!("{rid}: {e}"))?;
        let node = entry.node.unwrap_or(0);
        let (mut kept, mut size) = (0usize, 0u64);
        for l in &p.leaves {
            match leaf_verdict(url, &api_key, node, l, &vkey, witnesses)? {
                LeafVerdict::Kept { tree_size } => {
                    kept += 1;
                    size = size.max(tree_size);
                }
                LeafVerdict::Broken(why) => {
                    broken += 1;
                    println!(
                        "  BROKEN: {} seq {} ({}): {why}",
                        p.request_id, l.seq, l.table
                    );
                }
                LeafVerdict::Pending(why) => {
                    println!("  pending: {} seq {}: {why}", p.request_id, l.seq);
                }
            }
        }
        println!(
            "{} (node {node}) of tenant {}: {kept} of {} promised records proved in its tree of {size} records",
            p.request_id,
            p.tenant,
            p.leaves.len()
        );
    }
    if broken > 0 {
        println!(
            "promise BROKEN: {broken} promised record(s) are not in the node's signed tree (keep the answer and the proofs as evidence)"
        );
        std::process::exit(1);
    }
    println!("promises kept (so far as sealed)");
    Ok(())
}

/// One promised leaf held to the node's inclusion proof for its seq.
fn leaf_verdict(
    url: &str,
    api_key: &str,
    node: u64,
    l: &custody_audit::promise::PromisedLeaf,
    vkey: &str,
    witnesses: &[String],
) -> Result<LeafVerdict> {
    let path = format!("/v1/audit/proof/inclusion?node={node}&seq={}", l.seq);
    let r = custody_server::client::request(
        url,
        "GET",
        &path,
        Some(api_key),
        None,
        std::time::Duration::from_secs(60),
    )
    .with_context(|| format!("GET {url}{path}"))?;
    let body = String::from_utf8_lossy(&r.body).into_owned();
    match r.status {
        200 => {}
        404 => return Ok(LeafVerdict::Pending(body)),
        s => bail!("GET {path}: {s}: {body}"),
    }
    let proof = custody_audit::tlog::InclusionProof::parse(&r.body)
        .with_context(|| format!("{path}: not a tlog-proof"))?;
    if proof.index != l.seq {
        bail!("{path}: the node proved record {} instead", proof.index);
    }
    if !witnesses.is_empty() {
        let got = custody_audit::cosign::cosignatures(&proof.checkpoint, witnesses)
            .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
        if got.len() < witnesses.len() {
            bail!(
                "{path}: its checkpoint is cosigned by {} of the {} witnesses given",
                got.len(),
                witnesses.len()
            );
        }
    }
    // A checkpoint not signed by the node is a bad proof, not evidence against the node.
    let cp = custody_audit::tlog::open_checkpoint(&proof.checkpoint, vkey)
        .with_context(|| format!("{path}: the proof's checkpoint"))?;
    if !vkey.starts_with(&format!("{}+", cp.origin())) {
        bail!(
            "{path}: a checkpoint of {}, not of the promise's log",
            cp.origin()
        );
    }
    Ok(match proof.verify_leaf(vkey, l.leaf) {
        Ok(cp) => LeafVerdict::Kept {
            tree_size: cp.size(),
        },
        Err(e) => LeafVerdict::Broken(format!(
            "the node's signed tree does not hold the promised leaf there ({e})"
        )),
    })
}

/// `custody receipt verify`.
fn verify(
    receipt: &std::path::Path,
    node_key: &std::path::Path,
    witnesses: Vec<String>,
    min_witnesses: Option<usize>,
    promise: Option<PathBuf>,
) -> Result<()> {
    let json = std::fs::read(receipt).with_context(|| format!("reading {}", receipt.display()))?;
    let key = digest::read_verifying_key(node_key).map_err(anyhow::Error::msg)?;
    let policy = witness_policy(witnesses, min_witnesses)?;
    let checked = tree_store::verify_receipt(&json, &key, policy.as_ref()).and_then(|r| {
        let kept = match &promise {
            None => None,
            Some(p) => {
                let note = promise_note(p, &r.request_id).map_err(|e| {
                    tree_store::ReceiptError::Malformed(format!("the promise: {e:#}"))
                })?;
                Some(tree_store::check_promise(&r, &note, &key)?)
            }
        };
        Ok((r, kept))
    });
    match checked {
        Ok((r, kept)) => {
            println!(
                "receipt OK: {} of tenant {}: {} records in the tree of {} records of {}",
                r.request_id,
                r.tenant,
                r.records.len(),
                r.tree_size,
                r.origin
            );
            if let Some(k) = kept {
                println!(
                    "  promise kept: the {} records promised in the answer are in the log, unchanged{}",
                    k.promised,
                    if k.unpromised.is_empty() {
                        String::new()
                    } else {
                        format!(" ({} recorded after the answer)", k.unpromised.len())
                    }
                );
            }
            for c in &r.cosigned_by {
                println!("  cosigned by {} at {} s", c.witness, c.time_s);
            }
            for (seq, rec) in &r.records {
                let fields: Vec<String> = rec
                    .columns
                    .iter()
                    .filter(|(n, _)| !matches!(n.as_str(), "node_id" | "seq" | "ts_ns"))
                    .map(|(n, v)| {
                        format!(
                            "{n}={}",
                            v.as_ref().map_or("null".into(), ToString::to_string)
                        )
                    })
                    .collect();
                println!("  seq {seq} {}: {}", rec.table, fields.join(" "));
            }
            Ok(())
        }
        Err(e) => {
            println!("receipt FAILED: {e}");
            std::process::exit(1);
        }
    }
}

/// One entry of an answer's `custody_receipt` (or the note a file holds alone).
pub(crate) struct AnswerPromise {
    pub node: Option<u64>,
    pub request_id: Option<String>,
    /// The signed note, or why the answer carried none.
    pub note: std::result::Result<Vec<u8>, String>,
}

/// The promises in `path`: an answer's JSON (its `custody_receipt`, whole body or SSE chunk, or
/// the object itself), or a promise note's text.
pub(crate) fn answer_promises(path: &std::path::Path) -> Result<Vec<AnswerPromise>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return Ok(vec![AnswerPromise {
            node: None,
            request_id: None,
            note: Ok(bytes),
        }]);
    };
    let receipt = if v.get("custody_receipt").is_some() {
        &v["custody_receipt"]
    } else {
        &v
    };
    let entries = receipt["requests"]
        .as_array()
        .with_context(|| format!("{} has no custody_receipt.requests", path.display()))?;
    Ok(entries
        .iter()
        .map(|e| AnswerPromise {
            node: e["node"].as_u64(),
            request_id: e["request_id"].as_str().map(str::to_owned),
            note: match (e["promise"].as_str(), e["error"].as_str()) {
                (Some(n), _) => Ok(n.as_bytes().to_vec()),
                (None, Some(why)) => Err(why.to_owned()),
                (None, None) => Err("no promise and no reason".to_owned()),
            },
        })
        .collect())
}

/// The promise note of `request_id` in `path` ([`answer_promises`]; a lone note is taken as is).
fn promise_note(path: &std::path::Path, request_id: &str) -> Result<Vec<u8>> {
    let all = answer_promises(path)?;
    let entry = all
        .into_iter()
        .find(|p| p.request_id.is_none() || p.request_id.as_deref() == Some(request_id))
        .with_context(|| {
            format!(
                "{} has no custody_receipt entry for {request_id}",
                path.display()
            )
        })?;
    entry
        .note
        .map_err(|e| anyhow::anyhow!("the answer carried no promise for {request_id}: {e}"))
}

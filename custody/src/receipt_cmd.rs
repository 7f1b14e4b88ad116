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
    }
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

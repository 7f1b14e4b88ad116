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
    },
}

pub(crate) fn receipt_cmd(c: ReceiptCmd) -> Result<()> {
    let ReceiptCmd::Verify {
        receipt,
        node_key,
        witnesses,
        min_witnesses,
    } = c;
    let json = std::fs::read(&receipt).with_context(|| format!("reading {}", receipt.display()))?;
    let key = digest::read_verifying_key(&node_key).map_err(anyhow::Error::msg)?;
    let policy = if witnesses.is_empty() {
        None
    } else {
        let min = min_witnesses.unwrap_or(witnesses.len());
        if min == 0 || min > witnesses.len() {
            bail!(
                "--min-witnesses {min}: between 1 and the {} keys given",
                witnesses.len()
            );
        }
        Some(WitnessPolicy {
            vkeys: witnesses,
            min,
            checkpoints: Vec::new(),
        })
    };
    match tree_store::verify_receipt(&json, &key, policy.as_ref()) {
        Ok(r) => {
            println!(
                "receipt OK: {} of tenant {}: {} records in the tree of {} records of {}",
                r.request_id,
                r.tenant,
                r.records.len(),
                r.tree_size,
                r.origin
            );
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

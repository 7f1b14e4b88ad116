//! `custody witness`: a C2SP tlog witness (cosigner) for nodes' Merkle trees — an independent
//! process with its own key and storage (`custody_audit::tlog_witness`, served by
//! `custody_server::tlog_witness`). Not the eBPF witness (`custody probe`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Subcommand;

use custody_audit::digest;
use custody_audit::tlog_witness::{self, Witness};

#[derive(Subcommand, Debug)]
pub(crate) enum WitnessCmd {
    /// Serve `POST /add-checkpoint` (C2SP tlog-witness): cosign each configured log's
    /// checkpoint only with a valid consistency proof from the last one cosigned; keep a
    /// contradicting signed checkpoint as split-view evidence. Prints its verifier key.
    Serve {
        /// Address to listen on (plain HTTP; keep it on a trusted network).
        #[arg(long, default_value = "127.0.0.1:8788")]
        listen: String,
        /// The witness's Ed25519 key (`custody audit keygen`), not any node's.
        #[arg(long)]
        key: PathBuf,
        /// The witness's name (its cosignatures' key name, e.g. `witness1.example`).
        #[arg(long)]
        name: String,
        /// Where it keeps the newest cosigned checkpoint per log, and the evidence.
        #[arg(long)]
        state: PathBuf,
        /// A log it witnesses: the node's signed-note verifier key (`custody audit vkey`);
        /// repeatable.
        #[arg(long = "log", required = true)]
        logs: Vec<String>,
    },
    /// The split-view evidence a witness kept: each pair of signed checkpoints that
    /// contradict each other, checked again. Exit 1 if there is any.
    Evidence {
        #[arg(long)]
        state: PathBuf,
        /// The logs' verifier keys, to check both checkpoints' signatures again.
        #[arg(long = "log")]
        logs: Vec<String>,
    },
    /// Print the witness's cosignature verifier key (what nodes and `audit verify --witness`
    /// pin).
    Vkey {
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        name: String,
    },
}

pub(crate) fn witness_cmd(c: WitnessCmd) -> Result<()> {
    match c {
        WitnessCmd::Serve {
            listen,
            key,
            name,
            state,
            logs,
        } => serve(&listen, &key, &name, state, &logs),
        WitnessCmd::Evidence { state, logs } => evidence(&state, &logs),
        WitnessCmd::Vkey { key, name } => {
            let key = digest::read_signing_key(&key).map_err(anyhow::Error::msg)?;
            println!(
                "{}",
                custody_audit::cosign::vkey(&name, &key.verifying_key())
            );
            Ok(())
        }
    }
}

fn serve(
    listen: &str,
    key: &std::path::Path,
    name: &str,
    state: PathBuf,
    logs: &[String],
) -> Result<()> {
    let key = digest::read_signing_key(key).map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(&state).with_context(|| format!("creating {}", state.display()))?;
    let w = Arc::new(Witness::open(name, key, &state, logs)?);
    println!("tlog witness vkey: {}", w.vkey());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding {listen}"))?;
        // Handlers first: a test (or an operator) may signal as soon as it reads the line.
        let stop = crate::serve_cmd::shutdown_signal();
        println!("listening on {}", listener.local_addr()?);
        custody_server::tlog_witness::serve_witness(listener, w, stop)
            .await
            .map_err(anyhow::Error::from)
    })
}

fn evidence(state: &std::path::Path, logs: &[String]) -> Result<()> {
    let all = tlog_witness::evidence(state)?;
    if all.is_empty() {
        println!("no split-view evidence under {}", state.display());
        return Ok(());
    }
    for e in &all {
        println!(
            "EVIDENCE {} for {} (seen at {} s): {}",
            e.kind, e.origin, e.seen_s, e.why
        );
        for (what, note) in [("cosigned", &e.cosigned), ("offered ", &e.offered)] {
            let signed = logs
                .iter()
                .find(|v| v.split('+').next() == Some(e.origin.as_str()))
                .map(|v| custody_audit::tlog::open_checkpoint(note.as_bytes(), v));
            let verdict = match signed {
                Some(Ok(_)) => "signed by the log's key",
                Some(Err(_)) => "NOT signed by the log's key",
                None => "signature not checked (no --log key for this origin)",
            };
            println!("  {what} checkpoint ({verdict}):");
            for line in note.lines() {
                println!("    {line}");
            }
        }
    }
    std::process::exit(1);
}

//! `custody certs`: a fleet's CA and node certificates (mutual TLS between the fleet's
//! processes, `custody_runtime::disagg::tls`).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use custody_runtime::disagg::tls::{Fleet, NodeIdentity, Validity};

#[derive(Args, Debug)]
pub(crate) struct CertsArgs {
    /// Directory of the fleet: `ca.pem` and `ca.key` (created if absent, reused otherwise) and
    /// each node's `<role>-<node>.pem` / `.key`.
    #[arg(long)]
    out: PathBuf,
    /// A node to certify, as `prefill:1`, `decode:2` or `front:0` (its certificate's identity:
    /// `custody-node:<role>:<node>`). Repeatable.
    #[arg(long = "node", value_name = "ROLE:ID")]
    nodes: Vec<String>,
    /// Another name or address the nodes are reached by (DNS or IP SAN; `localhost` and
    /// 127.0.0.1 are always in). Repeatable.
    #[arg(long)]
    host: Vec<String>,
    /// Validity of new certificates, in days (the CA's: ten times this).
    #[arg(long, default_value_t = 365)]
    days: u32,
}

pub(crate) fn certs(a: CertsArgs) -> Result<()> {
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let (ca, ca_key) = (a.out.join("ca.pem"), a.out.join("ca.key"));
    let fleet = if ca.exists() {
        let read = |p: &Path| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        let fleet = Fleet::load(&read(&ca)?, &read(&ca_key)?).context("loading the fleet's CA")?;
        println!("CA {} (existing)", ca.display());
        fleet
    } else {
        let fleet = Fleet::new("custody fleet CA", a.days.saturating_mul(10))?;
        write_new(&ca, fleet.ca_pem(), 0o644)?;
        write_new(&ca_key, fleet.ca_key_pem(), 0o600)?;
        println!(
            "CA {} (new; its key {} signs node certificates)",
            ca.display(),
            ca_key.display()
        );
        fleet
    };
    for n in &a.nodes {
        let id = parse_node(n)?;
        let issued = fleet.issue(id, &a.host, Validity::Days(a.days))?;
        let base = format!("{}-{}", id.role.name(), id.node);
        let (cert, key) = (
            a.out.join(format!("{base}.pem")),
            a.out.join(format!("{base}.key")),
        );
        write_new(&cert, &issued.cert_pem, 0o644)?;
        write_new(&key, &issued.key_pem, 0o600)?;
        println!("{id}: {} {}", cert.display(), key.display());
    }
    Ok(())
}

/// `prefill:1` → the identity `custody-node:prefill:1`.
fn parse_node(s: &str) -> Result<NodeIdentity> {
    Ok(NodeIdentity::parse(&format!(
        "{}:{s}",
        custody_runtime::disagg::tls::IDENTITY_SCHEME
    ))?)
}

/// Write a file that must not exist yet (a fleet's keys are never overwritten).
fn write_new(path: &Path, text: &str, mode: u32) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {} (it must not exist yet)", path.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", path.display()))
}

//! `custody audit`: keys, verification, the writer benchmark, the synthetic log.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Subcommand;

use crate::common::parse_utc;

#[derive(Subcommand, Debug)]
pub(crate) enum AuditCmd {
    /// Create an Ed25519 signing key (hex seed, mode 0600) and its public key (`<out>.pub`).
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
    /// Verify the digest chain and every sealed file under an audit root. Exit code 1 on any
    /// problem.
    Verify {
        root: PathBuf,
        /// Expected public key (hex file from `keygen`); default: trust the key in the first digest.
        #[arg(long)]
        public_key: Option<PathBuf>,
        /// Only digests sealed at or after this UTC time (`YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SSZ`).
        #[arg(long)]
        from: Option<String>,
        /// Only digests sealed before this UTC time.
        #[arg(long)]
        to: Option<String>,
    },
    /// Generate a realistic synthetic log (many tenants, long contexts, page reuse) through the
    /// real writers, with injected exposures whose answers go to `<out>/synth-truth.json`.
    Synth(crate::synth_cmd::SynthArgs),
    /// Writer throughput (events/s on one core) and bytes per event on disk for a realistic mix.
    Bench {
        #[arg(long, default_value_t = 2_000_000)]
        events: u64,
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The eBPF witness's mix instead (`rdma_ops` rows: per page, three posted work requests
        /// and two completions), handed over as columns in batches as its collector does, into
        /// one segment sealed at the end (the live segment's and the sealing's cost apart).
        #[arg(long)]
        witness: bool,
    },
}

pub(crate) fn audit_cmd(a: AuditCmd) -> Result<()> {
    use custody_audit::digest;
    match a {
        AuditCmd::Keygen { out } => {
            let key = digest::generate_key().context("reading /dev/urandom")?;
            let pub_path = digest::write_key(&key, &out)
                .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "signing key: {}\npublic key:  {}",
                out.display(),
                pub_path.display()
            );
            Ok(())
        }
        AuditCmd::Verify {
            root,
            public_key,
            from,
            to,
        } => {
            let key = public_key
                .as_deref()
                .map(digest::read_verifying_key)
                .transpose()
                .map_err(anyhow::Error::msg)?;
            let from = from.as_deref().map(parse_utc).transpose()?;
            let to = to.as_deref().map(parse_utc).transpose()?;
            if !root.is_dir() {
                bail!("audit root {} is not a directory", root.display());
            }
            let r = digest::verify(&root, key.as_ref(), from, to);
            if key.is_none() {
                eprintln!(
                    "note: no --public-key given; signatures were checked against the key named in each node's first digest"
                );
            }
            println!("valid digests: {}", r.valid_digests);
            println!("valid files:   {}", r.valid_files);
            for p in &r.live_segments {
                println!(
                    "unsealed live segment (recoverable, not yet covered by a digest): {}",
                    p.display()
                );
            }
            for p in &r.problems {
                println!("FAIL: {p}");
            }
            if r.ok() {
                println!("audit log verified: OK");
                Ok(())
            } else {
                println!(
                    "audit log verification FAILED: {} problem(s)",
                    r.problems.len()
                );
                std::process::exit(1);
            }
        }
        AuditCmd::Bench {
            events,
            dir,
            witness,
        } => crate::bench::audit::audit_bench(events, dir, witness),
        AuditCmd::Synth(a) => crate::synth_cmd::synth(a),
    }
}

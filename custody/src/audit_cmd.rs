//! `custody audit`: keys, verification, the writer benchmark, the synthetic log.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Subcommand;

use custody_audit::digest;

use crate::common::parse_utc;
use crate::progress::Progress;

/// [`digest::verify`] through a store that counts what it reads, shown as progress (a root of
/// 10⁸ events is minutes of hashing).
fn verify_showing_progress(
    root: &std::path::Path,
    key: Option<&digest::VerifyingKey>,
    from: Option<i64>,
    to: Option<i64>,
) -> digest::Report {
    use std::sync::atomic::{AtomicU64, Ordering};
    /// The local store, counting objects read and hashed.
    struct Counting<'a> {
        inner: digest::LocalStore,
        done: AtomicU64,
        shown: &'a std::sync::Mutex<Progress>,
    }
    impl digest::LogStore for Counting<'_> {
        fn list(&self, prefix: &str) -> Result<Vec<String>, digest::StoreError> {
            let objects = self.inner.list(prefix)?;
            if let Ok(mut p) = self.shown.lock() {
                p.set_total(objects.len() as u64);
            }
            Ok(objects)
        }
        fn read(&self, path: &str) -> Result<Vec<u8>, digest::StoreError> {
            let r = self.inner.read(path);
            self.tick();
            r
        }
        fn sha256(&self, path: &str) -> Result<(String, u64), digest::StoreError> {
            let r = self.inner.sha256(path);
            self.tick();
            r
        }
        fn locate(&self, path: &str) -> std::path::PathBuf {
            self.inner.locate(path)
        }
    }
    impl Counting<'_> {
        fn tick(&self) {
            let n = self.done.fetch_add(1, Ordering::Relaxed) + 1;
            if let Ok(p) = self.shown.lock() {
                p.set(n);
            }
        }
    }
    let shown = std::sync::Mutex::new(Progress::counted("verify", 0, "objects"));
    let store = Counting {
        inner: digest::LocalStore::new(root),
        done: AtomicU64::new(0),
        shown: &shown,
    };
    let report = digest::verify_reporting(&store, key, from, to);
    let done = store.done.load(Ordering::Relaxed);
    if let Ok(p) = shown.into_inner() {
        p.finish(done);
    }
    report
}

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
            let r = verify_showing_progress(&root, key.as_ref(), from, to);
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

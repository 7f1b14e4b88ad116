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
    expect: &digest::Expect,
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
    let report = digest::verify_reporting(&store, key, from, to, expect);
    let done = store.done.load(Ordering::Relaxed);
    if let Ok(p) = shown.into_inner() {
        p.finish(done);
    }
    report
}

/// What `audit verify` holds the root to beyond its content.
fn expectations(
    places: &[String],
    nodes: Vec<u32>,
    max_age_s: Option<u64>,
    now: Option<&str>,
) -> Result<digest::Expect> {
    let mut checkpoints = Vec::new();
    for place in places {
        checkpoints.extend(read_checkpoints(place)?);
    }
    let freshness = match max_age_s {
        None => None,
        Some(s) => Some(digest::Freshness {
            now_wall_ns: match now {
                Some(t) => parse_utc(t)?,
                None => std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as i64),
            },
            max_age: std::time::Duration::from_secs(s),
        }),
    };
    Ok(digest::Expect {
        checkpoints,
        nodes,
        freshness,
        node_keys: Default::default(),
        witnesses: None,
    })
}

/// `N=FILE` pairs: each node's expected public key.
fn node_keys(pairs: &[String]) -> Result<std::collections::BTreeMap<u32, digest::VerifyingKey>> {
    let mut keys = std::collections::BTreeMap::new();
    for p in pairs {
        let (node, file) = p
            .split_once('=')
            .with_context(|| format!("--node-key {p:?}: expected N=FILE"))?;
        let node: u32 = node
            .parse()
            .with_context(|| format!("--node-key {p:?}: {node:?} is not a node id"))?;
        let key = digest::read_verifying_key(std::path::Path::new(file))
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("--node-key {p:?}"))?;
        keys.insert(node, key);
    }
    Ok(keys)
}

/// The checkpoints at `place`: a file, or (with `forensics`) an object-store prefix.
fn read_checkpoints(place: &str) -> Result<Vec<(custody_audit::checkpoint::Checkpoint, String)>> {
    use custody_audit::checkpoint::Checkpoint;
    if place.starts_with("s3://") {
        #[cfg(feature = "forensics")]
        return custody_query::checkpoints::fetch_checkpoints(place)
            .with_context(|| format!("reading checkpoints at {place}"));
        #[cfg(not(feature = "forensics"))]
        bail!("{place}: object stores need a build with the `forensics` feature");
    }
    let text = std::fs::read_to_string(place).with_context(|| format!("reading {place}"))?;
    let mut out = Vec::new();
    for cp in Checkpoint::parse_all(&text) {
        out.push((cp.with_context(|| format!("in {place}"))?, place.to_owned()));
    }
    if out.is_empty() {
        bail!("{place}: no checkpoint in it");
    }
    Ok(out)
}

/// `custody audit verify`'s arguments.
#[derive(clap::Args, Debug)]
pub(crate) struct VerifyArgs {
    root: PathBuf,
    /// Expected public key (hex file from `keygen`). Without it, each chain is checked against
    /// the key named in its own first digest (trust on first use): the verdict says
    /// UNAUTHENTICATED and the exit code is 3 (unless --allow-tofu).
    #[arg(long)]
    public_key: Option<PathBuf>,
    /// Accept a verification without --public-key (trust on first use): exit 0 when nothing
    /// else is wrong; the verdict line still says UNAUTHENTICATED.
    #[arg(long)]
    allow_tofu: bool,
    /// Only digests sealed at or after this UTC time (`YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SSZ`).
    #[arg(long)]
    from: Option<String>,
    /// Only digests sealed before this UTC time.
    #[arg(long)]
    to: Option<String>,
    /// A checkpoint kept outside the root — a file (a checkpoint place's `node=<n>.json`,
    /// or a log collector's lines) or `s3://bucket/prefix`; repeatable. Those inside the
    /// root (`_checkpoints/`, other nodes' logs) are always read.
    #[arg(long)]
    expect_checkpoint: Vec<String>,
    /// A node whose log must be in the root; repeatable.
    #[arg(long)]
    expect_node: Vec<u32>,
    /// Every node's newest sealing or checkpoint must be at most this many seconds old at
    /// `--now` (report a stale log).
    #[arg(long)]
    max_age_s: Option<u64>,
    /// The time `--max-age-s` is measured at (UTC; default: now).
    #[arg(long)]
    now: Option<String>,
    /// `N=FILE`: the expected public key of node N, over `--public-key` — for a root that
    /// holds other nodes' logs (a peer's, the witness's), whose kept checkpoints then count.
    /// Repeatable.
    #[arg(long)]
    node_key: Vec<String>,
    /// A tlog witness's cosignature verifier key (`custody witness vkey`); repeatable. Every
    /// node's tree must then have a checkpoint cosigned by `--min-witnesses` of them that the
    /// sealed records make.
    #[arg(long = "witness")]
    witnesses: Vec<String>,
    /// How many of the `--witness` keys must have cosigned (default: 1).
    #[arg(long, requires = "witnesses")]
    min_witnesses: Option<usize>,
    /// A cosigned checkpoint obtained from a witness (`GET <witness>/<sha256(origin)>/checkpoint`,
    /// or `custody witness`'s state): the node's sealed records must make it — a witness that
    /// cosigned a larger or another tree shows a cut, rolled-back or forked log. Repeatable.
    #[arg(long, requires = "witnesses")]
    witness_checkpoint: Vec<PathBuf>,
}

/// `audit verify`'s exit code when nothing is wrong but no key was pinned (trust on first use).
const EXIT_UNAUTHENTICATED: u8 = 3;

#[derive(Subcommand, Debug)]
pub(crate) enum AuditCmd {
    /// Create an Ed25519 signing key (hex seed, mode 0600) and its public key (`<out>.pub`).
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
    /// Verify the digest chain and every sealed file under an audit root
    ///
    /// Exit codes: 0 verified against a pinned key (`--public-key`); 1 any problem;
    /// 3 no problem found but UNAUTHENTICATED — no `--public-key` was given, so each chain was
    /// checked only against the key named in its own first digest (trust on first use: whoever
    /// rewrote the whole log with a key of their own would pass). `--allow-tofu` accepts that
    /// (exit 0; the verdict still says UNAUTHENTICATED).
    #[command(verbatim_doc_comment)]
    Verify(VerifyArgs),
    /// Write every tile of each node's Merkle tree — level 0 included (32 bytes per record),
    /// which the writer leaves out unless `[audit] level0_tiles` — from its sealed records,
    /// under `<root>/_tlog/node=<n>/tile/` (C2SP tlog-tiles), so the tree can be served
    /// statically. Each file is checked against its digest first; run `audit verify` after.
    Tiles {
        root: PathBuf,
        /// Only these nodes (repeatable); default: every node with a digest chain.
        #[arg(long)]
        node: Vec<u32>,
    },
    /// Print a node's tree verifier key (C2SP signed-note, Ed25519): what its tlog witnesses
    /// (`custody witness serve --log`) and a tenant's verifier pin. The origin is
    /// `[audit] origin`, else the default for the node and key.
    Vkey {
        /// The node's public key (hex, `<key>.pub`).
        #[arg(long)]
        public_key: PathBuf,
        #[arg(long, default_value_t = 0)]
        node: u32,
        /// The configured `[audit] origin`, if any.
        #[arg(long)]
        origin: Option<String>,
    },
    /// Prove, against a node's newest signed tree checkpoint (`_tlog/node=<n>/checkpoint`),
    /// that a record is in its Merkle tree (`--seq`: a C2SP tlog-proof@v1 file whose `extra`
    /// is the record's canonical bytes) or that the tree extends an older one (`--old`: the
    /// C2SP tlog-witness add-checkpoint body). Every hash used is authenticated against a root
    /// a digest signed; missing level-0 tiles are recomputed from the sealed records.
    Prove {
        root: PathBuf,
        #[arg(long, default_value_t = 0)]
        node: u32,
        /// The record's sequence number (its leaf index).
        #[arg(long, conflicts_with = "old", required_unless_present = "old")]
        seq: Option<u64>,
        /// The size of an older checkpoint of the same node.
        #[arg(long)]
        old: Option<u64>,
        /// Write the proof here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check a proof `audit prove` made, offline: the checkpoint signed by the node's key and
    /// the record (or the older checkpoint) in its tree. Exit 1 if it does not hold.
    CheckProof {
        proof: PathBuf,
        /// The node's public key (hex, as `audit keygen` writes `<key>.pub`).
        #[arg(long)]
        public_key: PathBuf,
        /// For a consistency proof: the older checkpoint note it starts from.
        #[arg(long)]
        old_checkpoint: Option<PathBuf>,
    },
    /// Hold the signed promise a node gave in an answer (`custody_receipt`) to that node's log
    /// under ROOT: each promised record proved at its seq against the node's (cosigned)
    /// checkpoint. Exit 1 if the log broke the promise (a fork, a rewrite, a rollback).
    CheckPromise {
        root: PathBuf,
        #[arg(long, default_value_t = 0)]
        node: u32,
        /// The answer's JSON (whole body, SSE chunk or its `custody_receipt`; the entry of
        /// `--node` is taken) or the promise note.
        #[arg(long)]
        promise: PathBuf,
        /// The node's public key (hex, `<key>.pub`).
        #[arg(long)]
        public_key: PathBuf,
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
        AuditCmd::Verify(v) => verify(v),
        AuditCmd::Bench {
            events,
            dir,
            witness,
        } => Ok(custody_bench::audit::audit_bench(events, dir, witness)?),
        AuditCmd::Synth(a) => crate::synth_cmd::synth(a),
        AuditCmd::Tiles { root, node } => tiles(&root, node),
        AuditCmd::Vkey {
            public_key,
            node,
            origin,
        } => {
            let key = digest::read_verifying_key(&public_key).map_err(anyhow::Error::msg)?;
            let origin =
                origin.unwrap_or_else(|| custody_audit::tree_store::default_origin(node, &key));
            if !custody_audit::tlog::is_key_name(&origin) {
                bail!("origin {origin:?}: not a signed-note key name (no spaces, no '+')");
            }
            println!("{}", custody_audit::tlog::ed25519_vkey(&origin, &key));
            Ok(())
        }
        AuditCmd::Prove {
            root,
            node,
            seq,
            old,
            out,
        } => prove(&root, node, seq, old, out),
        AuditCmd::CheckProof {
            proof,
            public_key,
            old_checkpoint,
        } => check_proof(&proof, &public_key, old_checkpoint.as_deref()),
        AuditCmd::CheckPromise {
            root,
            node,
            promise,
            public_key,
        } => check_promise(&root, node, &promise, &public_key),
    }
}

/// `custody audit check-promise`.
fn check_promise(
    root: &std::path::Path,
    node: u32,
    promise: &std::path::Path,
    public_key: &std::path::Path,
) -> Result<()> {
    let key = digest::read_verifying_key(public_key).map_err(anyhow::Error::msg)?;
    let entry = crate::receipt_cmd::answer_promises(promise)?
        .into_iter()
        .find(|p| p.node.is_none_or(|n| n == u64::from(node)))
        .with_context(|| format!("{} has no promise of node {node}", promise.display()))?;
    let note = entry
        .note
        .map_err(|e| anyhow::anyhow!("the answer carried no promise of node {node}: {e}"))?;
    let store = digest::LocalStore::new(root);
    let (p, found) = custody_audit::tree_store::check_promise_in_log(&store, node, &note, &key)?;
    println!(
        "{} of tenant {}: {} records promised; the log's tree of {} records (node {node}) holds {} of them as promised",
        p.request_id,
        p.tenant,
        p.leaves.len(),
        found.tree_size,
        found.kept.len()
    );
    if !found.pending.is_empty() {
        println!("  not sealed yet: seq {:?}", found.pending);
    }
    if found.broken.is_empty() {
        println!("promise kept");
        return Ok(());
    }
    for seq in &found.broken {
        let table = p
            .leaves
            .iter()
            .find(|l| l.seq == *seq)
            .map_or("?", |l| l.table.as_str());
        println!("  BROKEN: seq {seq} ({table}): the log holds another record there");
    }
    println!(
        "promise BROKEN: the node signed records its log does not hold (keep the answer and this log as evidence)"
    );
    std::process::exit(1);
}

/// `custody audit prove`: an inclusion or consistency proof to the node's newest checkpoint.
fn prove(
    root: &std::path::Path,
    node: u32,
    seq: Option<u64>,
    old: Option<u64>,
    out: Option<PathBuf>,
) -> Result<()> {
    use custody_audit::tlog::{ConsistencyProof, InclusionProof};
    let store = digest::LocalStore::new(root);
    let log = custody_audit::tree_store::NodeLog::open(&store, node)?;
    let note = log.checkpoint_note()?;
    let cp = custody_audit::tlog::note_checkpoint(&note)?;
    let size = cp.size();
    if log.root_at(size)? != *cp.hash() {
        bail!(
            "node {node}: the signed checkpoint's root for {size} records is not the one its digest signed: run `custody audit verify`"
        );
    }
    let bytes = match (seq, old) {
        (Some(seq), _) => InclusionProof {
            extra: Some(log.record(seq)?),
            index: seq,
            hashes: log.prove_inclusion(seq, size)?,
            checkpoint: note,
        }
        .to_bytes(),
        (None, Some(old)) => ConsistencyProof {
            old,
            hashes: log.prove_consistency(old, size)?,
            checkpoint: note,
        }
        .to_bytes(),
        (None, None) => bail!("give --seq or --old"),
    };
    match out {
        Some(p) => std::fs::write(&p, bytes).with_context(|| format!("writing {}", p.display())),
        None => {
            use std::io::Write as _;
            std::io::stdout().write_all(&bytes).context("stdout")
        }
    }
}

/// The verifier key of the node whose note this is: its origin line and the node's key.
fn node_vkey(note: &[u8], public_key: &std::path::Path) -> Result<String> {
    let key = digest::read_verifying_key(public_key).map_err(anyhow::Error::msg)?;
    let origin = note
        .split(|&b| b == b'\n')
        .next()
        .and_then(|l| std::str::from_utf8(l).ok())
        .unwrap_or_default();
    Ok(custody_audit::tlog::ed25519_vkey(origin, &key))
}

/// `custody audit check-proof`.
fn check_proof(
    proof: &std::path::Path,
    public_key: &std::path::Path,
    old_checkpoint: Option<&std::path::Path>,
) -> Result<()> {
    use custody_audit::tlog::{self, ConsistencyProof, InclusionProof};
    let bytes = std::fs::read(proof).with_context(|| format!("reading {}", proof.display()))?;
    if bytes.starts_with(tlog::PROOF_HEADER.as_bytes()) {
        let p = InclusionProof::parse(&bytes)?;
        let vkey = node_vkey(&p.checkpoint, public_key)?;
        let verdict = p.verify(&vkey);
        let cp = match verdict {
            Ok(cp) => cp,
            Err(e) => {
                println!("proof FAILED: {e}");
                std::process::exit(1);
            }
        };
        println!(
            "proof OK: record {} is in the tree of {} records of {} (root {})",
            p.index,
            cp.size(),
            cp.origin(),
            digest::hex(&cp.hash().0)
        );
        if let Some(r) = p.extra.as_deref() {
            print_record(r);
        }
        return Ok(());
    }
    let p = ConsistencyProof::parse(&bytes)?;
    let Some(old_path) = old_checkpoint else {
        bail!("a consistency proof is checked from an older checkpoint: give --old-checkpoint");
    };
    let old_note =
        std::fs::read(old_path).with_context(|| format!("reading {}", old_path.display()))?;
    let vkey = node_vkey(&p.checkpoint, public_key)?;
    let checked = tlog::open_checkpoint(&p.checkpoint, &vkey).and_then(|new| {
        let old = tlog::open_checkpoint(&old_note, &vkey)?;
        if old.size() != p.old || old.origin() != new.origin() {
            return Err(tlog::TlogError::MalformedProof(
                "the older checkpoint is not the proof's (size or origin)",
            ));
        }
        tlog::verify_consistency(&p.hashes, new.size(), *new.hash(), old.size(), *old.hash())?;
        Ok((old, new))
    });
    match checked {
        Ok((old, new)) => {
            println!(
                "proof OK: the tree of {} records of {} extends the one of {}",
                new.size(),
                new.origin(),
                old.size()
            );
            Ok(())
        }
        Err(e) => {
            println!("proof FAILED: {e}");
            std::process::exit(1);
        }
    }
}

/// A record's columns, one per line.
fn print_record(bytes: &[u8]) {
    match custody_audit::leaf::decode_record(bytes) {
        Ok(r) => {
            println!("  table {}", r.table);
            for (name, v) in &r.columns {
                let v = v.as_ref().map_or("null".to_owned(), ToString::to_string);
                println!("  {name} = {v}");
            }
        }
        Err(_) => println!("  (a lost record's placeholder, or not a canonical record)"),
    }
}

/// `custody audit tiles`: every node's tiles rebuilt from its sealed records.
fn tiles(root: &std::path::Path, mut nodes: Vec<u32>) -> Result<()> {
    if nodes.is_empty() {
        let dir = root.join("_digests");
        let rd = std::fs::read_dir(&dir)
            .with_context(|| format!("{}: no digest chain to rebuild from", dir.display()))?;
        for e in rd {
            let name = e?.file_name();
            if let Some(n) = name
                .to_str()
                .and_then(|n| n.strip_prefix("node="))
                .and_then(|n| n.parse().ok())
            {
                nodes.push(n);
            }
        }
        nodes.sort_unstable();
    }
    for n in nodes {
        let tree =
            custody_audit::tree_store::rebuild(root, n).with_context(|| format!("node {n}"))?;
        let root_hash = tree.root().with_context(|| format!("node {n}"))?;
        println!(
            "node {n}: {} records, root {}: tiles written under {}",
            tree.size(),
            digest::hex(&root_hash.0),
            root.join(custody_audit::tree_store::node_prefix(n))
                .display()
        );
    }
    Ok(())
}

/// `custody audit verify`: the report, then the verdict line and its exit code.
fn verify(v: VerifyArgs) -> Result<()> {
    let key = v
        .public_key
        .as_deref()
        .map(digest::read_verifying_key)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let from = v.from.as_deref().map(parse_utc).transpose()?;
    let to = v.to.as_deref().map(parse_utc).transpose()?;
    if !v.root.is_dir() {
        bail!("audit root {} is not a directory", v.root.display());
    }
    let mut expect = expectations(
        &v.expect_checkpoint,
        v.expect_node,
        v.max_age_s,
        v.now.as_deref(),
    )?;
    expect.node_keys = node_keys(&v.node_key)?;
    if !v.witnesses.is_empty() {
        for w in &v.witnesses {
            custody_audit::cosign::CosignatureVerifier::new(w)
                .with_context(|| format!("--witness {w}"))?;
        }
        let min = v.min_witnesses.unwrap_or(1);
        if min == 0 || min > v.witnesses.len() {
            bail!(
                "--min-witnesses {min}: between 1 and the {} --witness keys given",
                v.witnesses.len()
            );
        }
        let mut checkpoints = Vec::new();
        for p in &v.witness_checkpoint {
            let note = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
            checkpoints.push((note, p.display().to_string()));
        }
        expect.witnesses = Some(custody_audit::tree_store::WitnessPolicy {
            vkeys: v.witnesses.clone(),
            min,
            checkpoints,
        });
    }
    let r = verify_showing_progress(&v.root, key.as_ref(), from, to, &expect);
    print_report(&r);
    let code = verdict(&r, key.is_some(), v.allow_tofu);
    if code == 0 {
        return Ok(());
    }
    std::process::exit(i32::from(code));
}

/// What the verification found, before its verdict.
fn print_report(r: &digest::Report) {
    println!("valid digests: {}", r.valid_digests);
    println!("valid files:   {}", r.valid_files);
    println!("checkpoints:   {}", r.checkpoints);
    for (node, place) in &r.newest_checkpoints {
        println!("  node {node}: newest checkpoint from {place}");
    }
    if r.checkpoints == 0 {
        println!(
            "note: no checkpoint found: a deletion of the newest sealings cannot be seen (keep checkpoints outside the root and pass --expect-checkpoint)"
        );
    }
    for (node, t) in &r.trees {
        use custody_audit::tree_store::TreeStatus;
        match t {
            TreeStatus::Checked {
                size,
                root,
                checkpoint_size,
                witnessed_size,
            } => {
                let cp = checkpoint_size.map_or("none".to_owned(), |s| format!("{s} records"));
                println!(
                    "  node {node}: Merkle tree of {size} records rebuilt from the sealed records, root {root}; signed tree checkpoint: {cp}"
                );
                if let Some(w) = witnessed_size {
                    println!(
                        "  node {node}: cosigned by the witnesses up to {w} records ({} not yet)",
                        size - w
                    );
                }
            }
            TreeStatus::NotChecked(why) => {
                println!("  node {node}: Merkle tree NOT checked: {why}");
            }
            TreeStatus::Absent => println!(
                "  node {node}: no Merkle tree (sealed before the transparency log existed)"
            ),
        }
    }
    for p in &r.live_segments {
        println!(
            "unsealed live segment (recoverable, not yet covered by a digest): {}",
            p.display()
        );
    }
    for p in &r.problems {
        println!("FAIL: {p}");
    }
}

/// The verdict line and the exit code: 1 on any problem; without a pinned key, UNAUTHENTICATED
/// and [`EXIT_UNAUTHENTICATED`] (0 with `--allow-tofu`); else OK and 0.
fn verdict(r: &digest::Report, pinned: bool, allow_tofu: bool) -> u8 {
    if !r.ok() {
        println!(
            "audit log verification FAILED: {} problem(s)",
            r.problems.len()
        );
        return 1;
    }
    if pinned {
        println!("audit log verified: OK");
        return 0;
    }
    let accepted = if allow_tofu {
        "accepted with --allow-tofu"
    } else {
        "pass --public-key to authenticate it, or --allow-tofu to accept this"
    };
    println!(
        "audit log verified: UNAUTHENTICATED (consistent, but no --public-key: each chain was checked against the key in its own first digest; {accepted})"
    );
    if allow_tofu { 0 } else { EXIT_UNAUTHENTICATED }
}

//! The audit writer a command records into: from flags, the config's `[audit]` section, or — a
//! serving command (`serve`, `prefill`, `decode`) given neither — the default root, with a key
//! made on first use (`custody_audit::defaults`). `--no-audit` is the only way to serve without
//! one: said at ERROR, and refused for a pair's or a fleet's node unless its config has
//! `[audit] allow_no_audit = true` too.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use custody_audit::config::AuditSection;
use custody_audit::writer::AuditWriter;

/// Audit options shared by commands that run the engine.
#[derive(Args, Debug)]
pub(crate) struct AuditArgs {
    /// Record every page event into this audit root (Parquet); requires --audit-key. Serving
    /// commands given neither this nor `[audit] dir` record into the default root
    /// ($XDG_STATE_HOME/custody/audit, else ~/.local/state/custody/audit).
    #[arg(long)]
    pub(crate) audit_dir: Option<PathBuf>,
    /// Ed25519 signing key for the digest chain (`custody audit keygen`); with the default
    /// root, default: <state dir>/node.key, made (mode 0600, and its .pub) on first use.
    #[arg(long)]
    pub(crate) audit_key: Option<PathBuf>,
    /// Node id recorded in the audit log.
    #[arg(long, default_value_t = 0)]
    pub(crate) node: u32,
    /// Also publish the log's signed checkpoints into this directory (another disk or mount);
    /// repeatable; added to [audit] checkpoint_dirs.
    #[arg(long)]
    pub(crate) checkpoint_dir: Vec<PathBuf>,
    /// Also publish them to this object-store prefix (`s3://bucket/prefix`).
    #[arg(long)]
    pub(crate) checkpoint_url: Option<String>,
    /// Keep in this log the checkpoints another node (a peer) publishes into this directory;
    /// repeatable; added to [audit] checkpoints_from.
    #[arg(long)]
    pub(crate) checkpoints_from: Vec<PathBuf>,
}

/// A node's audit writer, and what a pair's peer checkpoint exchange needs of it.
pub(crate) struct NodeAudit {
    pub(crate) writer: Arc<AuditWriter>,
    /// The writer's newest checkpoint (one of its sinks).
    pub(crate) latest: Arc<custody_audit::checkpoint::Latest>,
    /// The writer's checkpoint interval.
    pub(crate) checkpoint_interval: std::time::Duration,
    /// With `[audit] witnesses`: the cosigner's counters.
    pub(crate) cosign: Option<Arc<crate::cosign_client::CosignStats>>,
    /// The audit root and node (proofs and receipts are read from there).
    pub(crate) root: PathBuf,
    pub(crate) node: u32,
}

/// What a serving process is, for `--no-audit`: a pair's or a fleet's node (named) needs the
/// config's consent too.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Serving {
    /// `custody serve` with its own engine.
    Colocated,
    /// A pair's or a fleet's process: `prefill`, `decode`, a pair's front, a fleet's router.
    Fleet(&'static str),
}

/// Where a log goes and what signs it.
struct Target {
    dir: PathBuf,
    key: custody_audit::digest::SigningKey,
    node: u32,
}

/// The audit writer from flags, falling back to the config's `[audit]` section (`cfg_path`);
/// none when neither names a root (a command that serves nothing: `generate`).
pub(crate) fn open_audit(
    a: &AuditArgs,
    cfg_path: Option<&Path>,
) -> Result<Option<Arc<AuditWriter>>> {
    let conf = match cfg_path {
        Some(p) => crate::config::Config::load(p)?.audit,
        None => AuditSection::default(),
    };
    let Some(t) = explicit_target(a, &conf)? else {
        return Ok(None);
    };
    Ok(Some(open_writer(a, &conf, t)?.writer))
}

/// A serving command's writer: flags, else `conf`, else the default root — or none with
/// `no_audit` (refused for [`Serving::Fleet`] unless `conf.allow_no_audit`).
pub(crate) fn open_serving_audit(
    a: &AuditArgs,
    no_audit: bool,
    conf: &AuditSection,
    what: Serving,
) -> Result<Option<NodeAudit>> {
    if no_audit {
        refuse_or_announce_no_audit(conf, what)?;
        return Ok(None);
    }
    let t = match explicit_target(a, conf)? {
        Some(t) => t,
        None => default_target(a, conf)?,
    };
    Ok(Some(open_writer(a, conf, t)?))
}

/// `--no-audit`: refused for a pair's or fleet's process without `[audit] allow_no_audit`;
/// else said at ERROR.
fn refuse_or_announce_no_audit(conf: &AuditSection, what: Serving) -> Result<()> {
    if let Serving::Fleet(role) = what
        && !conf.allow_no_audit
    {
        bail!(
            "--no-audit refused ({role}): a pair's or fleet's process serves without an audit log only when its config says so too ([audit] allow_no_audit = true)"
        );
    }
    tracing::error!(
        "AUDIT IS OFF (--no-audit): no page event is recorded, no access can be proven afterwards; /metrics says custody_audit_disabled 1 and /health/ready reports degraded"
    );
    Ok(())
}

/// The root and key the flags or `[audit]` name; none when no root is named.
fn explicit_target(a: &AuditArgs, conf: &AuditSection) -> Result<Option<Target>> {
    let Some(dir) = a.audit_dir.clone().or(conf.dir.clone()) else {
        return Ok(None);
    };
    let key_path = a.audit_key.clone().or(conf.key.clone()).context(
        "an audit directory needs a signing key: --audit-key or [audit] key (create one with `custody audit keygen`)",
    )?;
    let key = custody_audit::digest::read_signing_key(&key_path).map_err(anyhow::Error::msg)?;
    Ok(Some(Target {
        dir,
        key,
        node: node_id(a, conf),
    }))
}

/// The default root, signed by the named key or else the default one (made now if absent, and
/// said so).
fn default_target(a: &AuditArgs, conf: &AuditSection) -> Result<Target> {
    use custody_audit::defaults;
    let dir = defaults::default_root()?;
    let key = match a.audit_key.as_ref().or(conf.key.as_ref()) {
        Some(p) => custody_audit::digest::read_signing_key(p).map_err(anyhow::Error::msg)?,
        None => default_key()?,
    };
    tracing::info!(
        root = %dir.display(),
        "audit log in the default root (--audit-dir or [audit] dir to choose another, --no-audit to refuse one)"
    );
    Ok(Target {
        dir,
        key,
        node: node_id(a, conf),
    })
}

/// The default signing key, made on first use (and said so, with where its public key is).
fn default_key() -> Result<custody_audit::digest::SigningKey> {
    let path = custody_audit::defaults::default_key_path()?;
    let (key, made) = custody_audit::defaults::load_or_create_key(&path)?;
    if made {
        tracing::warn!(
            key = %path.display(),
            public_key = %format!("{}.pub", path.display()),
            "audit signing key generated (mode 0600): keep the .pub elsewhere too, and verify with --public-key"
        );
    }
    Ok(key)
}

fn node_id(a: &AuditArgs, conf: &AuditSection) -> u32 {
    if a.node != 0 { a.node } else { conf.node }
}

/// The writer for `t`, configured by `[audit]` and the flags.
fn open_writer(a: &AuditArgs, conf: &AuditSection, t: Target) -> Result<NodeAudit> {
    use custody_audit::writer::{Backpressure, FsyncPolicy, WriterConfig};
    let mut cfg = WriterConfig::new(&t.dir, t.node, t.key);
    cfg.fsync = match conf.fsync_interval_ms {
        0 => FsyncPolicy::EveryBatch,
        ms => FsyncPolicy::Interval(std::time::Duration::from_millis(ms)),
    };
    if conf.seal_interval_s > 0 {
        cfg.rotate_interval = std::time::Duration::from_secs(conf.seal_interval_s);
    }
    if conf.checkpoint_interval_s > 0 {
        cfg.checkpoint_interval = std::time::Duration::from_secs(conf.checkpoint_interval_s);
    }
    cfg.checkpoint_sinks = checkpoint_sinks(a, conf)?;
    let cosigner = if conf.witnesses.is_empty() {
        if conf.require_cosignatures > 0 {
            anyhow::bail!("[audit] require_cosignatures needs [[audit.witnesses]]");
        }
        None
    } else {
        for w in &conf.witnesses {
            custody_audit::cosign::CosignatureVerifier::new(&w.vkey)
                .with_context(|| format!("[audit] witnesses: {}", w.url))?;
        }
        if conf.require_cosignatures > conf.witnesses.len() {
            anyhow::bail!(
                "[audit] require_cosignatures = {}: more than the {} witnesses configured",
                conf.require_cosignatures,
                conf.witnesses.len()
            );
        }
        let c = crate::cosign_client::start(
            t.dir.clone(),
            t.node,
            conf.witnesses.clone(),
            conf.require_cosignatures,
        )?;
        cfg.checkpoint_sinks.push(c.sink.clone());
        Some(c)
    };
    cfg.origin = conf.origin.clone();
    cfg.level0_tiles = conf.level0_tiles;
    let latest = Arc::new(custody_audit::checkpoint::Latest::default());
    cfg.checkpoint_sinks.push(latest.clone());
    let checkpoint_interval = cfg.checkpoint_interval;
    if conf.allow_drop {
        tracing::warn!(
            "audit allow_drop is on: events may be dropped under load (each drop is counted in the log)"
        );
        cfg.backpressure = Backpressure::AllowDrop;
    }
    let w =
        AuditWriter::open(cfg).with_context(|| format!("opening audit log {}", t.dir.display()))?;
    let w = Arc::new(w);
    if let Some(c) = &cosigner {
        // Set once, here: the cosigner records its failures into this log.
        let _ = c.writer.set(Arc::downgrade(&w));
    }
    for from in conf.checkpoints_from.iter().chain(&a.checkpoints_from) {
        relay_checkpoints(from.clone(), w.clone(), None)?;
    }
    Ok(NodeAudit {
        writer: w,
        latest,
        checkpoint_interval,
        cosign: cosigner.map(|c| c.stats),
        root: t.dir.clone(),
        node: t.node,
    })
}

/// How often a relay looks for new checkpoints in a peer's checkpoint directory.
const CHECKPOINT_RELAY_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// A thread that keeps, in `log`, the checkpoints another node publishes into `dir` (see
/// `custody_audit::checkpoint::Relay`), until `stop` is set or the log is closed.
pub(crate) fn relay_checkpoints(
    dir: PathBuf,
    log: std::sync::Arc<custody_audit::writer::AuditWriter>,
    stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
) -> Result<()> {
    use std::sync::atomic::Ordering;
    let mut relay = custody_audit::checkpoint::Relay::new(&dir, log);
    std::thread::Builder::new()
        .name("checkpoint-relay".into())
        .spawn(move || {
            while !stop.as_ref().is_some_and(|s| s.load(Ordering::Acquire)) {
                if let Err(e) = relay.poll() {
                    tracing::debug!(error = %e, "checkpoint relay stopped: the log is closed");
                    return;
                }
                std::thread::sleep(CHECKPOINT_RELAY_INTERVAL);
            }
            // A last look: what the node published just before the stop.
            let _ = relay.poll();
        })
        .with_context(|| format!("starting the checkpoint relay from {}", dir.display()))?;
    Ok(())
}

/// Where the writer publishes its checkpoints, from flags and `[audit]`.
fn checkpoint_sinks(
    a: &AuditArgs,
    conf: &custody_audit::config::AuditSection,
) -> Result<Vec<std::sync::Arc<dyn custody_audit::checkpoint::CheckpointSink>>> {
    use custody_audit::checkpoint::{CheckpointSink, DirSink, StdoutSink};
    let mut sinks: Vec<std::sync::Arc<dyn CheckpointSink>> = Vec::new();
    for d in conf.checkpoint_dirs.iter().chain(&a.checkpoint_dir) {
        sinks.push(std::sync::Arc::new(DirSink::new(d)));
    }
    if conf.checkpoint_stdout {
        sinks.push(std::sync::Arc::new(StdoutSink));
    }
    if let Some(url) = a.checkpoint_url.as_ref().or(conf.checkpoint_url.as_ref()) {
        sinks.push(object_checkpoint_sink(url)?);
    }
    Ok(sinks)
}

#[cfg(feature = "forensics")]
fn object_checkpoint_sink(
    url: &str,
) -> Result<std::sync::Arc<dyn custody_audit::checkpoint::CheckpointSink>> {
    let sink = custody_query::checkpoints::ObjectCheckpointSink::s3(url)
        .with_context(|| format!("checkpoint place {url}"))?;
    Ok(std::sync::Arc::new(sink))
}

#[cfg(not(feature = "forensics"))]
fn object_checkpoint_sink(
    url: &str,
) -> Result<std::sync::Arc<dyn custody_audit::checkpoint::CheckpointSink>> {
    anyhow::bail!("checkpoint place {url}: object stores need a build with the `forensics` feature")
}

/// Seal a node's log after a clean shutdown: a `node_events` row `stop` first, so that an
/// incarnation without one is known to have ended otherwise (killed, crashed) — and the rows it
/// had not yet written are known to be lost, not absent (`custody forensics fleet`).
pub(crate) fn stop_and_seal(w: &custody_audit::writer::AuditWriter) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let ev = custody_audit::Event::Node {
        ts_ns: custody_audit::mono_now_ns(),
        kind: "stop".into(),
        detail: "clean shutdown".into(),
    };
    custody_audit::AuditSink::record(w, ev).context("recording the stop")?;
    w.close().context("sealing the audit log")?;
    Ok(())
}

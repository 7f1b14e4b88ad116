//! `custody probe`: attach the eBPF witness to a running process (`--pid`) or to every process of
//! an executable (`--binary`) and record what it sees into an audit root, as its own node.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use custody_audit::writer::{AuditWriter, WriterConfig};
use custody_ebpf::{Target, Witness, WitnessConfig, collector};

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "binary"])))]
pub(crate) struct ProbeArgs {
    /// Watch this process (its executable and the libraries it maps). Stops when it exits.
    #[arg(long)]
    pid: Option<u32>,
    /// Watch every process running this executable (and, for libibverbs, the installed library).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Audit root to record into (tables `rdma_ops`, `rdma_mr`; facts in `node_events`).
    #[arg(long)]
    audit: PathBuf,
    /// Ed25519 signing key for the digest chain (`custody audit keygen`).
    #[arg(long)]
    audit_key: PathBuf,
    /// Node id of the observing host in the audit log (default: derived from the host name,
    /// high bit set so it never collides with an engine node's small id). Must differ from
    /// every engine node writing into the same root.
    #[arg(long)]
    node: Option<u32>,
    /// Witness configuration: attach points and ring-buffer settings (default: the built-in
    /// `configs/witness.toml`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Stop after this many seconds (default: until the process exits, or Ctrl-C / SIGTERM).
    #[arg(long)]
    duration_s: Option<u64>,
    /// Keep, in the witness's own log, the signed checkpoints the watched node publishes into
    /// this directory (its `--checkpoint-dir` / `[audit] checkpoint_dirs`): a cut of the node's
    /// tail then shows against the witness's record. Repeatable.
    #[arg(long)]
    checkpoints_from: Vec<PathBuf>,
}

/// The observing host's node id: FNV-1a of the host name with the high bit set.
fn host_node() -> u32 {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mut h: u32 = 0x811c_9dc5;
    for b in name.trim().bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h | 0x8000_0000
}

pub(crate) fn probe(a: ProbeArgs) -> Result<()> {
    let cfg = match &a.config {
        Some(p) => WitnessConfig::from_toml(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )?,
        None => WitnessConfig::default_config(),
    };
    let (target, label) = match (&a.pid, &a.binary) {
        (Some(pid), _) => (Target::Pid(*pid), format!("pid {pid}")),
        (None, Some(b)) => (Target::Binary(b.clone()), format!("binary {}", b.display())),
        (None, None) => bail!("--pid or --binary is required"),
    };
    let node = a.node.unwrap_or_else(host_node);
    let key = custody_audit::digest::read_signing_key(&a.audit_key).map_err(anyhow::Error::msg)?;
    let writer = Arc::new(
        AuditWriter::open(WriterConfig::new(&a.audit, node, key))
            .with_context(|| format!("opening audit log {}", a.audit.display()))?,
    );
    let mut witness = Witness::attach(&cfg, &target).context("attaching the eBPF witness")?;
    for p in witness.attached() {
        eprintln!(
            "attached {} to {}:{} (offset {:#x}{})",
            p.program,
            p.binary.display(),
            p.symbol,
            p.file_offset,
            p.version
                .as_deref()
                .map(|v| format!(", version {v}"))
                .unwrap_or_default()
        );
    }
    collector::record_start(&witness, &label, &*writer)?;

    let stop = Arc::new(AtomicBool::new(false));
    // Ctrl-C / SIGTERM, the target's exit and the duration all end the run the same way: the
    // collector drains the ring buffer, records its totals, and the log is sealed.
    {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("probe-signals".into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(async {
                    let mut term = match tokio::signal::unix::signal(
                        tokio::signal::unix::SignalKind::terminate(),
                    ) {
                        Ok(s) => s,
                        Err(_) => return,
                    };
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                    }
                });
                stop.store(true, Ordering::Release);
            })?;
    }
    {
        let stop = stop.clone();
        let (pid, limit) = (a.pid, a.duration_s.map(Duration::from_secs));
        std::thread::Builder::new()
            .name("probe-watch".into())
            .spawn(move || {
                let t0 = Instant::now();
                while !stop.load(Ordering::Acquire) {
                    let gone =
                        pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists());
                    if gone || limit.is_some_and(|l| t0.elapsed() >= l) {
                        stop.store(true, Ordering::Release);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })?;
    }
    for dir in &a.checkpoints_from {
        crate::audit_open::relay_checkpoints(dir.clone(), writer.clone(), Some(stop.clone()))?;
    }
    eprintln!(
        "recording into {} as node {node}; Ctrl-C to stop",
        a.audit.display()
    );
    let stats = collector::run_with(
        &mut witness,
        &*writer,
        &stop,
        cfg.poll_interval(),
        cfg.record_sges,
    )?;
    writer.close().context("sealing the audit log")?;
    eprintln!(
        "witness: {} transfer-path ops, {} registrations; lost: {}",
        stats.ops, stats.registrations, stats.lost
    );
    if stats.lost.total() > 0 {
        bail!(
            "the witness lost {} events ({}); its record is incomplete (see node_events: witness_lost)",
            stats.lost.total(),
            stats.lost
        );
    }
    Ok(())
}

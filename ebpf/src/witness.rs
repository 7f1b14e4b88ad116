//! The loader: loads the BPF object, attaches its programs where the configuration says, and
//! reads the ring buffer and the lost-event counters.

use std::num::NonZeroU32;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::{Array, MapData, PerCpuArray, RingBuf};
use aya::programs::UProbe;
use aya::programs::uprobe::{UProbeAttachLocation, UProbeScope};
use aya::{Ebpf, EbpfLoader};
use serde::Deserialize;

use crate::event::{DecodeError, Observation};
use crate::symbols;

/// The compiled BPF object (empty when clang was missing at build time).
static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/witness.bpf.o"));

/// The built-in configuration (`configs/witness.toml`).
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/witness.toml");

/// Bound on the ring buffer (the loader refuses larger).
const MAX_RING_BYTES: u32 = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub enum WitnessError {
    #[error(
        "the BPF object was not built (clang was missing when custody-ebpf was compiled); \
         run scripts/setup.sh and rebuild"
    )]
    ObjectNotBuilt,
    #[error("eBPF is not permitted here: {0}")]
    NotPermitted(String),
    #[error("witness configuration: {0}")]
    Config(String),
    #[error("loading the BPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("BPF program {program}: {detail}")]
    Program { program: String, detail: String },
    #[error("BPF map {map}: {detail}")]
    Map { map: &'static str, detail: String },
    #[error("attach point {program} on {binary}:{symbol}: {detail}")]
    Attach {
        program: String,
        binary: PathBuf,
        symbol: String,
        detail: String,
    },
    #[error("resolving a symbol: {0}")]
    Symbol(#[from] symbols::SymbolError),
    #[error("waiting for the ring buffer: {0}")]
    Poll(std::io::Error),
    #[error("target process {0} not found: {1}")]
    NoProcess(u32, std::io::Error),
}

/// One attach point: which program, on which binary, at which symbol.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AttachSpec {
    pub program: String,
    pub binary: String,
    pub symbol: String,
    #[serde(default)]
    pub optional: bool,
}

/// The witness's configuration (`configs/witness.toml`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WitnessConfig {
    pub ring_buffer_bytes: u32,
    pub wakeup_threshold_bytes: u64,
    pub poll_interval_ms: u64,
    /// Record every scatter/gather entry (`rdma_ops.sges`: local address, length, key) — the
    /// source memory of each write — or only their count and total bytes (measured cost:
    /// BENCHMARKS.md).
    #[serde(default)]
    pub record_sges: bool,
    pub attach: Vec<AttachSpec>,
}

impl WitnessConfig {
    pub fn from_toml(s: &str) -> Result<Self, WitnessError> {
        let c: Self = toml::from_str(s).map_err(|e| WitnessError::Config(e.to_string()))?;
        let page = 4096u32;
        if !c.ring_buffer_bytes.is_power_of_two()
            || c.ring_buffer_bytes < page
            || c.ring_buffer_bytes > MAX_RING_BYTES
        {
            return Err(WitnessError::Config(format!(
                "ring_buffer_bytes = {} must be a power of two between {page} and {MAX_RING_BYTES}",
                c.ring_buffer_bytes
            )));
        }
        if c.wakeup_threshold_bytes >= u64::from(c.ring_buffer_bytes) {
            return Err(WitnessError::Config(
                "wakeup_threshold_bytes must be below ring_buffer_bytes (or the reader would \
                 only be woken by its timer)"
                    .into(),
            ));
        }
        if c.poll_interval_ms == 0 || c.poll_interval_ms > 10_000 {
            return Err(WitnessError::Config(
                "poll_interval_ms must be 1..=10000".into(),
            ));
        }
        Ok(c)
    }

    pub fn default_config() -> Self {
        match Self::from_toml(DEFAULT_CONFIG) {
            Ok(c) => c,
            Err(e) => unreachable!("the built-in configuration is valid (tested): {e}"),
        }
    }

    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_interval_ms)
    }
}

/// What to observe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// One running process (its executable and the libraries it maps).
    Pid(u32),
    /// Every process running this executable.
    Binary(PathBuf),
}

/// An attach point that is live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attached {
    pub program: String,
    pub binary: PathBuf,
    pub symbol: String,
    pub file_offset: u64,
    pub version: Option<String>,
}

/// Events lost, by cause (summed over CPUs). Reported by the collector, never silent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lost {
    pub ring_full: u64,
    pub chain_truncated: u64,
    pub sge_truncated: u64,
    pub read_fault: u64,
    pub pending_full: u64,
    /// Records the collector could not decode.
    pub undecodable: u64,
}

impl Lost {
    pub fn total(&self) -> u64 {
        self.ring_full
            + self.chain_truncated
            + self.sge_truncated
            + self.read_fault
            + self.pending_full
            + self.undecodable
    }
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ring_full={} chain_truncated={} sge_truncated={} read_fault={} pending_full={} undecodable={}",
            self.ring_full,
            self.chain_truncated,
            self.sge_truncated,
            self.read_fault,
            self.pending_full,
            self.undecodable
        )
    }
}

/// Whether this process may load BPF and create uprobes; the reason when not.
pub fn check_permitted() -> Result<(), WitnessError> {
    if OBJECT.is_empty() {
        return Err(WitnessError::ObjectNotBuilt);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(WitnessError::NotPermitted(format!(
            "not root (euid {euid}): loading BPF programs and uprobes needs CAP_BPF + CAP_PERFMON \
             (run as root)"
        )));
    }
    let pmu = Path::new("/sys/bus/event_source/devices/uprobe/type");
    if !pmu.exists() {
        return Err(WitnessError::NotPermitted(format!(
            "this kernel has no uprobe PMU ({} is missing)",
            pmu.display()
        )));
    }
    Ok(())
}

/// A loaded, attached witness.
pub struct Witness {
    bpf: Ebpf,
    ring: RingBuf<MapData>,
    lost: PerCpuArray<MapData, u64>,
    attached: Vec<Attached>,
    undecodable: u64,
}

impl std::fmt::Debug for Witness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Witness")
            .field("attached", &self.attached)
            .field("undecodable", &self.undecodable)
            .finish_non_exhaustive()
    }
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> WitnessError {
    move |e| WitnessError::Map {
        map,
        detail: e.to_string(),
    }
}

impl Witness {
    /// Load the programs and attach every configured point for `target`. A required point that
    /// cannot be attached is an error; an optional one whose binary is absent (or not mapped by
    /// the target process) is skipped and logged.
    pub fn attach(cfg: &WitnessConfig, target: &Target) -> Result<Self, WitnessError> {
        check_permitted()?;
        let mut bpf = EbpfLoader::new()
            .map_max_entries("events", cfg.ring_buffer_bytes)
            .load(OBJECT)?;
        let mut config: Array<&mut MapData, u64> =
            Array::try_from(bpf.map_mut("config").ok_or(WitnessError::Map {
                map: "config",
                detail: "missing from the object".into(),
            })?)
            .map_err(map_err("config"))?;
        config
            .set(0, cfg.wakeup_threshold_bytes, 0)
            .map_err(map_err("config"))?;
        config
            .set(1, u64::from(cfg.record_sges), 0)
            .map_err(map_err("config"))?;

        let (exe, scope) = match target {
            Target::Pid(pid) => {
                let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
                    .map_err(|e| WitnessError::NoProcess(*pid, e))?;
                let nz = NonZeroU32::new(*pid)
                    .ok_or_else(|| WitnessError::Config("pid 0 is not a process".into()))?;
                (exe, UProbeScope::OneProcess(nz))
            }
            Target::Binary(p) => (p.clone(), UProbeScope::AllProcesses),
        };
        let mut attached = Vec::new();
        let mut loaded: Vec<String> = Vec::new();
        for spec in &cfg.attach {
            let binary = if spec.binary == "@target" {
                Some(exe.clone())
            } else {
                match target {
                    Target::Pid(pid) => symbols::mapped_library(*pid, &spec.binary),
                    Target::Binary(_) => symbols::find_library(&spec.binary),
                }
            };
            let Some(binary) = binary else {
                if spec.optional {
                    tracing::info!(program = %spec.program, binary = %spec.binary, "attach point skipped: the target does not use this binary");
                    continue;
                }
                return Err(WitnessError::Attach {
                    program: spec.program.clone(),
                    binary: PathBuf::from(&spec.binary),
                    symbol: spec.symbol.clone(),
                    detail: "binary not found".into(),
                });
            };
            let def = symbols::resolve(&binary, &spec.symbol)?;
            let prog: &mut UProbe = bpf
                .program_mut(&spec.program)
                .ok_or_else(|| WitnessError::Program {
                    program: spec.program.clone(),
                    detail: "not in the BPF object".into(),
                })?
                .try_into()
                .map_err(|e: aya::programs::ProgramError| WitnessError::Program {
                    program: spec.program.clone(),
                    detail: e.to_string(),
                })?;
            if !loaded.contains(&spec.program) {
                prog.load().map_err(|e| WitnessError::Program {
                    program: spec.program.clone(),
                    detail: verifier_tail(&e),
                })?;
                loaded.push(spec.program.clone());
            }
            prog.attach(
                UProbeAttachLocation::AbsoluteOffset(def.file_offset),
                &binary,
                scope,
            )
            .map_err(|e| WitnessError::Attach {
                program: spec.program.clone(),
                binary: binary.clone(),
                symbol: spec.symbol.clone(),
                detail: e.to_string(),
            })?;
            tracing::info!(program = %spec.program, binary = %binary.display(), symbol = %spec.symbol, offset = def.file_offset, version = ?def.version, "attached");
            attached.push(Attached {
                program: spec.program.clone(),
                binary,
                symbol: spec.symbol.clone(),
                file_offset: def.file_offset,
                version: def.version,
            });
        }
        let ring = RingBuf::try_from(bpf.take_map("events").ok_or(WitnessError::Map {
            map: "events",
            detail: "missing from the object".into(),
        })?)
        .map_err(map_err("events"))?;
        let lost = PerCpuArray::try_from(bpf.take_map("lost").ok_or(WitnessError::Map {
            map: "lost",
            detail: "missing from the object".into(),
        })?)
        .map_err(map_err("lost"))?;
        Ok(Self {
            bpf,
            ring,
            lost,
            attached,
            undecodable: 0,
        })
    }

    pub fn attached(&self) -> &[Attached] {
        &self.attached
    }

    /// Wait up to `timeout` for the ring buffer to signal (BPF wakes it only past the threshold),
    /// then hand up to `max` records to `f`. Returns how many were handed.
    pub fn poll(
        &mut self,
        timeout: Duration,
        max: usize,
        mut f: impl FnMut(Observation),
    ) -> Result<usize, WitnessError> {
        let mut pfd = libc::pollfd {
            fd: self.ring.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd for the duration of the call; the fd is the ring buffer's,
        // owned by `self.ring`.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(WitnessError::Poll(e));
            }
        }
        Ok(self.drain(max, &mut f))
    }

    /// Hand up to `max` available records to `f` without waiting.
    pub fn drain(&mut self, max: usize, f: &mut impl FnMut(Observation)) -> usize {
        let mut n = 0;
        while n < max {
            let Some(item) = self.ring.next() else { break };
            match Observation::decode_all(&item, &mut *f) {
                Ok(_) => {}
                Err(e) => {
                    self.undecodable += 1;
                    log_undecodable(&e);
                }
            }
            n += 1;
        }
        n
    }

    /// The lost-event counters, summed over CPUs.
    pub fn lost(&self) -> Result<Lost, WitnessError> {
        let sum = |i: u32| -> Result<u64, WitnessError> {
            Ok(self.lost.get(&i, 0).map_err(map_err("lost"))?.iter().sum())
        };
        Ok(Lost {
            ring_full: sum(0)?,
            chain_truncated: sum(1)?,
            sge_truncated: sum(2)?,
            read_fault: sum(3)?,
            pending_full: sum(4)?,
            undecodable: self.undecodable,
        })
    }

    /// Programs in the object (for diagnostics).
    pub fn programs(&self) -> Vec<String> {
        self.bpf.programs().map(|(n, _)| n.to_owned()).collect()
    }

    /// The kernel's run statistics of each program that ran since this witness loaded it (its
    /// `fdinfo`: `run_cnt`, `run_time_ns`), counted only while `kernel.bpf_stats_enabled` is 1
    /// (see [`BpfStats`]): the cost of a probe hit where it happens, inside the traced threads.
    pub fn program_stats(&self) -> Vec<ProgramStats> {
        use std::os::fd::{AsFd, AsRawFd};
        self.bpf
            .programs()
            .filter_map(|(name, p)| {
                let fd = p.fd().ok()?.as_fd().as_raw_fd();
                let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
                let field = |k: &str| {
                    info.lines()
                        .find_map(|l| l.strip_prefix(k))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .unwrap_or(0)
                };
                Some(ProgramStats {
                    program: name.to_owned(),
                    runs: field("run_cnt:"),
                    run_ns: field("run_time_ns:"),
                })
            })
            .filter(|s| s.runs > 0)
            .collect()
    }
}

/// One program's kernel run statistics ([`Witness::program_stats`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramStats {
    pub program: String,
    pub runs: u64,
    pub run_ns: u64,
}

/// Turns the kernel's BPF run statistics on (`kernel.bpf_stats_enabled = 1`) for its lifetime
/// and restores the previous setting on drop. The statistics cost two clock reads per program
/// run; only benchmarks use them.
#[derive(Debug)]
pub struct BpfStats {
    previous: String,
}

const BPF_STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl BpfStats {
    pub fn enable() -> std::io::Result<Self> {
        let previous = std::fs::read_to_string(BPF_STATS_SYSCTL)?;
        std::fs::write(BPF_STATS_SYSCTL, "1")?;
        Ok(Self { previous })
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(BPF_STATS_SYSCTL, self.previous.trim()) {
            tracing::warn!(error = %e, "could not restore kernel.bpf_stats_enabled");
        }
    }
}

/// The error with the end of the verifier's log (where its verdict is), not all of it.
fn verifier_tail(e: &aya::programs::ProgramError) -> String {
    const TAIL_CHARS: usize = 1500;
    let full = format!("{e:?}");
    let start = full
        .char_indices()
        .rev()
        .nth(TAIL_CHARS)
        .map_or(0, |(i, _)| i);
    format!("{e} (verifier log, end: …{})", &full[start..])
}

fn log_undecodable(e: &DecodeError) {
    tracing::warn!(error = %e, "witness record could not be decoded (counted as lost)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_config_parses_and_names_every_program() {
        let c = WitnessConfig::default_config();
        assert_eq!(c.attach.len(), 11);
        assert!(c.attach.iter().any(|a| a.symbol == "custody_kv_post_write"));
        assert!(
            WitnessConfig::from_toml(&DEFAULT_CONFIG.replace("4194304", "1000")).is_err(),
            "a ring that is not a power of two is refused"
        );
    }
}

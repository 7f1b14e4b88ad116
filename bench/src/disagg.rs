//! `custody bench-disagg`: the disaggregated path against references measured in the same run
//! — KV transfer vs memcpy, time to first token and decode tok/s disaggregated vs colocated,
//! release fills, and the eBPF witness's cost (attached vs detached, paired).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Context, Result, bail};
use clap::Args;
use custody_runtime::config::UnsafeReproduction;
use custody_runtime::{Engine, Model, SamplingParams};

use crate::stats::{median, quantile};

#[derive(Args, Debug)]
pub struct BenchDisaggArgs {
    /// GGUF model; default: the embedded one.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Pages per transfer repetition.
    #[arg(long, default_value_t = 256)]
    pages: usize,
    /// Repetitions (medians reported); colocated and disaggregated runs alternate.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 32)]
    gen_tokens: usize,
    /// Requests per release-fill measurement.
    #[arg(long, default_value_t = 8)]
    fill_requests: usize,
    /// Also measure the eBPF witness (needs root): transfer throughput with the witness attached
    /// to this process vs detached, alternating in the same run, and the cost of one probe hit.
    #[arg(long)]
    witness: bool,
    /// Only the witness measurement (implies --witness).
    #[arg(long)]
    witness_only: bool,
}

/// The witness's cost: `custody_kv_*` probe hits and whole transfers, attached vs detached.
fn witness_bench(
    a: &BenchDisaggArgs,
    geom: custody_kernels::attention::PageGeometry,
    layers: usize,
) -> Result<()> {
    use custody_ebpf::WitnessConfig;
    use custody_runtime::disagg::bench::{TransferRig, process_cpu_s};
    use custody_runtime::transport::abi::{self, SendWr, Sge};

    custody_ebpf::check_permitted().context("the witness benchmark needs BPF")?;
    let dir = std::env::temp_dir().join(format!("custody-witness-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let key = custody_audit::digest::generate_key().context("key")?;
    let mut wcfg = custody_audit::writer::WriterConfig::new(&dir, 0x8000_0000, key);
    if let Ok(ms) = std::env::var("CUSTODY_WITNESS_BENCH_FSYNC_MS") {
        // Measurement knob: fsync the witness's live segment at most this often.
        wcfg.fsync = custody_audit::writer::FsyncPolicy::Interval(Duration::from_millis(
            ms.parse().context("CUSTODY_WITNESS_BENCH_FSYNC_MS")?,
        ));
    }
    let writer = Arc::new(custody_audit::writer::AuditWriter::open(wcfg)?);
    let cfg = WitnessConfig::default_config();
    let discard: Arc<dyn custody_audit::AuditSink> =
        Arc::new(custody_audit::DiscardSink::default());
    let audit: Arc<dyn custody_audit::AuditSink> = writer.clone();
    let attached_to =
        |sink: &Arc<dyn custody_audit::AuditSink>, sges: bool, f: &mut dyn FnMut()| {
            let mut c = cfg.clone();
            c.record_sges = sges;
            with_witness(&c, sink.clone(), f)
        };

    // Cost per probe hit (default configuration: no SGE lists in the records): a minimal hit
    // (register) and a page's chain (3 requests x 10 SGEs, the shape of a full page's gathered
    // writes), each timed over many calls.
    const CALLS: u32 = 200_000;
    let buf = vec![0u8; 4096];
    let sges: Vec<Sge> = (0..30)
        .map(|i| Sge {
            addr: buf.as_ptr() as u64 + i * 64,
            length: 64,
            lkey: 0,
        })
        .collect();
    let mut wrs: Vec<SendWr> = (0..3)
        .map(|i| SendWr::rdma_write(i, &sges[i as usize * 10..(i as usize + 1) * 10], 0x1000, 1))
        .collect();
    for i in 0..2 {
        let next: *const SendWr = &wrs[i + 1];
        wrs[i].next = next;
    }
    let wcs: Vec<abi::Wc> = (0..16)
        .map(|i| abi::Wc::new(i, 0, abi::wc_opcode::RDMA_WRITE, 4096, 0))
        .collect();
    let time_hits = || {
        let t0 = Instant::now();
        for i in 0..CALLS {
            std::hint::black_box(abi::custody_kv_register(1, i, 0, 0));
        }
        let reg = t0.elapsed().as_secs_f64() / f64::from(CALLS);
        let t0 = Instant::now();
        for _ in 0..CALLS / 10 {
            std::hint::black_box(abi::custody_kv_post_write(1, &wrs[0]));
        }
        let post = t0.elapsed().as_secs_f64() / f64::from(CALLS / 10);
        let t0 = Instant::now();
        for _ in 0..CALLS / 10 {
            abi::announce_completions(1, &wcs);
        }
        (
            reg,
            post,
            t0.elapsed().as_secs_f64() / f64::from(CALLS / 10),
        )
    };
    let (reg0, post0, wc0) = time_hits();
    let mut hits = (0.0, 0.0, 0.0);
    let (st, _) = attached_to(&discard, false, &mut || hits = time_hits())?;
    println!(
        "witness probe hit: register {:.2} us (detached {:.3} us), post of a 3-request chain {:.2} us (detached {:.3} us), a batch of 16 completions {:.2} us (detached {:.3} us); collector lost {}",
        (hits.0 - reg0) * 1e6,
        reg0 * 1e6,
        (hits.1 - post0) * 1e6,
        post0 * 1e6,
        (hits.2 - wc0) * 1e6,
        wc0 * 1e6,
        st.lost
    );

    // Transfer throughput at each batch size, on one warm connection: blocks of back-to-back
    // transfers (about BLOCK_S each, so the collector and the writer run at their steady rate
    // inside the block: wake-ups every poll interval, a batch and fsync every flush interval),
    // detached and attached alternating. Each attached block is compared with the mean of the
    // detached blocks either side of it (paired ratios; the variants' order rotates per rep),
    // and the medians of the ratios are reported — wall-clock time per transfer, and the
    // process's CPU time per transfer (all threads: the probes run in the posting and
    // completing threads, the collector and its writer in threads of this process). Work the
    // collector has not done when a block ends (at most one poll interval's records) is not
    // counted.
    const BLOCK_S: f64 = 0.3;
    const VARIANTS: [&str; 3] = [
        "default (no SGE lists), into the audit log",
        "SGE lists recorded, into the audit log",
        "probes only (collector discarding)",
    ];
    for pages in [16usize, a.pages] {
        let mut rig = TransferRig::new(geom, layers, pages, None);
        let mut warm: Vec<f64> = (0..8).map(|_| rig.transfer(false, false)).collect();
        warm.drain(..3);
        let per_block = ((BLOCK_S / median(warm)).ceil() as usize).clamp(3, 10_000);
        let block = |rig: &mut TransferRig| {
            let (t0, c0) = (Instant::now(), process_cpu_s());
            for _ in 0..per_block {
                std::hint::black_box(rig.transfer(false, false));
            }
            let n = per_block as f64;
            (t0.elapsed().as_secs_f64() / n, (process_cpu_s() - c0) / n)
        };
        let mut detached = vec![block(&mut rig)];
        let mut wall: [Vec<f64>; 3] = Default::default();
        let mut cpu: [Vec<f64>; 3] = Default::default();
        for rep in 0..a.reps {
            let mut v = [(0.0, 0.0); 3];
            for k in 0..3 {
                let i = (k + rep) % 3;
                let (sink, sges) = match i {
                    0 => (&audit, false),
                    1 => (&audit, true),
                    _ => (&discard, false),
                };
                let (st, _) = attached_to(sink, sges, &mut || v[i] = block(&mut rig))?;
                if st.lost.total() > 0 {
                    bail!("the witness lost events during the benchmark: {}", st.lost);
                }
            }
            let d = block(&mut rig);
            let prev = detached[detached.len() - 1];
            let (dw, dc) = ((prev.0 + d.0) / 2.0, (prev.1 + d.1) / 2.0);
            for i in 0..3 {
                wall[i].push(v[i].0 / dw - 1.0);
                cpu[i].push(v[i].1 / dc - 1.0);
            }
            detached.push(d);
        }
        let dw = median(detached.iter().map(|d| d.0).collect());
        let dc = median(detached.iter().map(|d| d.1).collect());
        println!(
            "transfer {pages} pages ({:.2} MiB) over tcp loopback, {per_block} transfers per block, {} reps: witness detached {:.3} ms wall, {:.3} ms CPU per transfer",
            rig.bytes() as f64 / f64::from(1 << 20),
            a.reps,
            dw * 1e3,
            dc * 1e3
        );
        for (i, name) in VARIANTS.iter().enumerate() {
            let (w, c) = (wall[i].clone(), cpu[i].clone());
            println!(
                "  attached, {name}: wall {:+.2}% (quartiles {:+.2}% .. {:+.2}%), CPU {:+.2}% (quartiles {:+.2}% .. {:+.2}%)",
                median(w.clone()) * 100.0,
                quantile(w.clone(), 0.25) * 100.0,
                quantile(w, 0.75) * 100.0,
                median(c.clone()) * 100.0,
                quantile(c.clone(), 0.25) * 100.0,
                quantile(c, 0.75) * 100.0,
            );
        }
        // Where the probes' time goes, in context: one more attached block (default
        // configuration, into the audit log) with the kernel's BPF run statistics on — not part
        // of the ratios above, as the statistics add two clock reads per program run.
        let stats = custody_ebpf::BpfStats::enable().context("enabling kernel.bpf_stats")?;
        // Seal what earlier blocks left, so that the writer's CPU below is this block's rows:
        // written live, then sealed to Parquet, digested and signed (one segment's fixed cost
        // included).
        writer.rotate()?;
        writer.sync()?;
        let writer_cpu0 = writer.writer_cpu_ns();
        let mut cpu_block = 0.0;
        let (st, progs) = attached_to(&audit, false, &mut || {
            cpu_block = block(&mut rig).1;
        })?;
        // The writer's CPU for this block's rows: written to the live segment, then sealed
        // (Parquet, digest, signature); and a segment's fixed sealing cost, measured on a
        // segment of one row, taken out of the block's (a segment is sealed every 64 MiB or
        // 5 minutes, not per block).
        writer.sync()?;
        let writer_cpu1 = writer.writer_cpu_ns();
        writer.rotate()?;
        writer.sync()?;
        let writer_cpu2 = writer.writer_cpu_ns();
        audit.record(custody_audit::Event::Node {
            ts_ns: custody_audit::mono_now_ns(),
            kind: "bench".into(),
            detail: "one-row segment".into(),
        })?;
        writer.sync()?;
        let writer_cpu3 = writer.writer_cpu_ns();
        writer.rotate()?;
        writer.sync()?;
        let seal_fixed_ns = writer.writer_cpu_ns().saturating_sub(writer_cpu3);
        let live_ns = writer_cpu1.saturating_sub(writer_cpu0);
        let seal_ns = writer_cpu2
            .saturating_sub(writer_cpu1)
            .saturating_sub(seal_fixed_ns);
        let writer_ns = live_ns + seal_ns;
        drop(stats);
        let transfers = per_block as f64;
        let per_hit: Vec<String> = progs
            .iter()
            .map(|p| {
                format!(
                    "{} {:.0} ns x {:.1} per transfer",
                    p.program,
                    p.run_ns as f64 / p.runs as f64,
                    p.runs as f64 / transfers
                )
            })
            .collect();
        println!(
            "  in context (kernel BPF run statistics): {}; {:.1} records per transfer ({:.1} per page); lost {}",
            per_hit.join(", "),
            st.ops as f64 / transfers,
            st.ops as f64 / transfers / pages as f64,
            st.lost
        );
        // Counted: CPU the witness's own code used, per transfer — its programs (kernel
        // statistics), its collector thread and its writer thread — against the detached
        // transfer's CPU. A lower bound: the uprobe entry and exit around each program, and
        // what the witness does to the transfer's caches, are not counted (the paired ratios
        // above include them).
        let prog_us = progs.iter().map(|p| p.run_ns).sum::<u64>() as f64 / transfers / 1e3;
        let coll_us = st.cpu_ns as f64 / transfers / 1e3;
        let writer_us = writer_ns as f64 / transfers / 1e3;
        let counted = prog_us + coll_us + writer_us;
        println!(
            "  counted witness CPU per transfer: programs {prog_us:.1} us + collector {coll_us:.1} us + writer {writer_us:.1} us (live segment {:.1}, sealing {:.1}) = {counted:.1} us = {:.2}% of the detached transfer's CPU ({:.3} ms; this block attached {:.3} ms); a segment's fixed sealing cost {:.1} ms, not counted",
            live_ns as f64 / transfers / 1e3,
            seal_ns as f64 / transfers / 1e3,
            counted / (dc * 1e6) * 100.0,
            dc * 1e3,
            cpu_block * 1e3,
            seal_fixed_ns as f64 / 1e6
        );
    }

    // The witness on a core of its own, as it is deployed (`custody probe` is its own process;
    // an operator gives it a housekeeping core): the transfer's threads pinned to CPU 0, the
    // witness's collector and audit writer to CPU 1, detached and attached (default, into the
    // audit log) alternating and paired as above. The transfer has one core here, so its
    // baseline is slower than above; the ratio is what the witness costs the transfer path
    // itself — the probes, run inline in the posting and completing threads, and what the
    // witness's threads do to the caches and memory bandwidth the transfer shares — while the
    // witness's own work is done beside it rather than taken from it.
    let n_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if n_cpus >= 2 {
        for pages in [16usize, a.pages] {
            let mut rig = TransferRig::new(geom, layers, pages, None);
            pin_threads(Some((0, 1)))?;
            let mut warm: Vec<f64> = (0..8).map(|_| rig.transfer(false, false)).collect();
            warm.drain(..3);
            let per_block = ((BLOCK_S / median(warm)).ceil() as usize).clamp(3, 10_000);
            let block = |rig: &mut TransferRig| -> Result<(f64, f64)> {
                pin_threads(Some((0, 1)))?;
                let (t0, c0) = (Instant::now(), process_cpu_s());
                for _ in 0..per_block {
                    std::hint::black_box(rig.transfer(false, false));
                }
                let n = per_block as f64;
                Ok((t0.elapsed().as_secs_f64() / n, (process_cpu_s() - c0) / n))
            };
            let mut detached = vec![block(&mut rig)?];
            let (mut wall, mut cpu) = (Vec::new(), Vec::new());
            for _ in 0..a.reps {
                let mut v = Ok((0.0, 0.0));
                let (st, _) = attached_to(&audit, false, &mut || v = block(&mut rig))?;
                let v = v?;
                if st.lost.total() > 0 {
                    bail!("the witness lost events during the benchmark: {}", st.lost);
                }
                let d = block(&mut rig)?;
                let prev = detached[detached.len() - 1];
                wall.push(v.0 / ((prev.0 + d.0) / 2.0) - 1.0);
                cpu.push(v.1 / ((prev.1 + d.1) / 2.0) - 1.0);
                detached.push(d);
            }
            pin_threads(None)?;
            println!(
                "transfer {pages} pages, its threads on CPU 0 and the witness's collector and writer on CPU 1, {per_block} transfers per block, {} reps: detached {:.3} ms wall per transfer; attached (default, into the audit log): wall {:+.2}% (quartiles {:+.2}% .. {:+.2}%), process CPU {:+.2}% (quartiles {:+.2}% .. {:+.2}%)",
                a.reps,
                median(detached.iter().map(|d| d.0).collect()) * 1e3,
                median(wall.clone()) * 100.0,
                quantile(wall.clone(), 0.25) * 100.0,
                quantile(wall, 0.75) * 100.0,
                median(cpu.clone()) * 100.0,
                quantile(cpu.clone(), 0.25) * 100.0,
                quantile(cpu, 0.75) * 100.0,
            );
        }
    }
    writer.close()?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Pin every thread of this process: `Some((transfer_cpu, witness_cpu))` puts the witness's
/// threads (its collector, `witness-collect`, and audit writers, `audit-writer-*`) on
/// `witness_cpu` and every other thread on `transfer_cpu`; `None` lets every thread run on
/// every CPU again.
fn pin_threads(cpus: Option<(usize, usize)>) -> Result<()> {
    custody_runtime::disagg::bench::pin_threads(cpus, |comm| {
        comm.starts_with("witness-collect") || comm.starts_with("audit-writer")
    })
    .context("pinning this process's threads")
}

/// Attach the witness to this process with its collector recording into `sink`, run `f`,
/// detach: the collector's counts and the programs' kernel run statistics (non-zero only under
/// `BpfStats`).
fn with_witness(
    cfg: &custody_ebpf::WitnessConfig,
    sink: Arc<dyn custody_audit::AuditSink>,
    f: &mut dyn FnMut(),
) -> Result<(
    custody_ebpf::collector::CollectStats,
    Vec<custody_ebpf::ProgramStats>,
)> {
    use custody_ebpf::{Target, Witness, collector};
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut w = Witness::attach(cfg, &Target::Pid(std::process::id()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let (interval, sges) = (cfg.poll_interval(), cfg.record_sges);
    let h = std::thread::Builder::new()
        .name("witness-collect".into())
        .spawn(move || {
            let r = collector::run_with(&mut w, &*sink, &s, interval, sges);
            (r, w.program_stats())
        })
        .context("spawning the collector")?;
    f();
    stop.store(true, Ordering::Release);
    let (r, progs) = h
        .join()
        .map_err(|_| crate::BenchError::Invalid("collector thread panicked".into()))?;
    Ok((r?, progs))
}

/// The witness on the engine's real path: whole requests through an in-process disaggregated
/// pair (prefill, the KV transfer of the prompt's pages, decode), detached and attached
/// alternating; the witness recording into its own audit log as `custody probe` does.
fn witness_pair_bench(
    pair: &custody_runtime::disagg::client::Pair,
    req: &custody_runtime::GenerateRequest,
    reps: usize,
) -> Result<()> {
    use custody_ebpf::WitnessConfig;
    let dir = std::env::temp_dir().join(format!("custody-witness-pair-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let key = custody_audit::digest::generate_key().context("key")?;
    let writer = Arc::new(custody_audit::writer::AuditWriter::open(
        custody_audit::writer::WriterConfig::new(&dir, 0x8000_0001, key),
    )?);
    let cfg = WitnessConfig::default_config();
    let run = |pair: &custody_runtime::disagg::client::Pair| -> Result<(f64, f64, f64)> {
        let t0 = Instant::now();
        let g = pair
            .generate(req)
            .map_err(|s| crate::BenchError::Invalid(s.message().to_owned()))?;
        let total = t0.elapsed().as_secs_f64();
        let tps = (g.tokens.len() - 1) as f64 / (g.total - g.ttft).as_secs_f64();
        Ok((g.ttft.as_secs_f64(), tps, total))
    };
    run(pair)?; // warm-up
    let (mut ttft, mut tps, mut total): (Vec<f64>, Vec<f64>, Vec<f64>) = Default::default();
    let mut ops = 0u64;
    for _ in 0..reps {
        let d = run(pair)?;
        let mut x = Ok((0.0, 0.0, 0.0));
        let (st, _) = with_witness(&cfg, writer.clone(), &mut || x = run(pair))?;
        let x = x?;
        if st.lost.total() > 0 {
            bail!("the witness lost events during the benchmark: {}", st.lost);
        }
        ops += st.ops;
        ttft.push(x.0 / d.0 - 1.0);
        tps.push(x.1 / d.1 - 1.0);
        total.push(x.2 / d.2 - 1.0);
    }
    writer.close()?;
    let _ = std::fs::remove_dir_all(&dir);
    let pct = |v: &Vec<f64>| {
        format!(
            "{:+.2}% (quartiles {:+.2}% .. {:+.2}%)",
            median(v.clone()) * 100.0,
            quantile(v.clone(), 0.25) * 100.0,
            quantile(v.clone(), 0.75) * 100.0
        )
    };
    println!(
        "whole requests through the pair ({} prompt tokens, {} generated; {:.0} witness records per request), witness attached into its audit log vs detached, paired: time to first token {}, decode tok/s {}, request time {}; {reps} reps",
        req.prompt.len(),
        req.max_tokens,
        ops as f64 / reps as f64,
        pct(&ttft),
        pct(&tps),
        pct(&total),
    );
    Ok(())
}

pub fn bench_disagg(a: BenchDisaggArgs) -> Result<()> {
    // The engines here step on threads of their own: one pool of every core for all of them.
    crate::set_default_pool(0)?;
    use custody_runtime::disagg::bench::transfer_bench;
    use custody_runtime::disagg::client::{Pair, PairOptions};
    use custody_runtime::engine::Event;
    use custody_runtime::kv::ReleaseFill;
    let path = a
        .model
        .clone()
        .unwrap_or_else(custody_runtime::config::default_model_path);
    let load = || Model::load(&path).with_context(|| format!("loading {}", path.display()));
    let model = load()?;
    let fingerprint = model.gguf().sha256_hex();
    let (geom, layers) = (
        model.page_geometry(16, custody_runtime::kv::KvType::F16),
        model.config.n_layers,
    );
    let vocab = model.config.vocab_size as u32;
    println!("# custody bench-disagg (reps {}, medians)", a.reps);
    if a.witness || a.witness_only {
        witness_bench(&a, geom, layers)?;
    }

    if !a.witness_only {
        let t = transfer_bench(geom, layers, a.pages, a.reps, Some(rig_tls()?));
        let [memcpy_s, transfer_s, checksum_s, inline_s, checksum_only_s] = [
            &t.memcpy_s,
            &t.transfer_s,
            &t.transfer_checksum_s,
            &t.transfer_checksum_inline_s,
            &t.checksum_only_s,
        ]
        .map(|v| median(v.clone()));
        println!(
            "transfer {} pages ({:.1} MiB): memcpy {:.2} GB/s | tcp loopback {:.2} GB/s = {:.2}x memcpy | tcp + checksum (hashed at prefill completion, verified on landing) {:.2} GB/s = {:.2}x memcpy | tcp + checksum hashed inside the transfer {:.2} GB/s = {:.2}x memcpy | checksum alone {:.2} GB/s",
            a.pages,
            t.bytes as f64 / (1 << 20) as f64,
            t.gbps(memcpy_s),
            t.gbps(transfer_s),
            memcpy_s / transfer_s,
            t.gbps(checksum_s),
            memcpy_s / checksum_s,
            t.gbps(inline_s),
            memcpy_s / inline_s,
            t.gbps(checksum_only_s),
        );
        if let Some(e) = &t.encrypted {
            let [enc_s, enc_checksum_s] =
                [&e.transfer_s, &e.transfer_checksum_s].map(|v| median(v.clone()));
            println!(
                "transport_encryption (TLS 1.3, rustls/ring), same pages, alternating with the plaintext runs: {:.2} GB/s = {:.2}x memcpy = {:.2}x plaintext | + checksum {:.2} GB/s = {:.2}x plaintext + checksum | connect incl. pairing proof: plaintext {:.2} ms, TLS {:.2} ms",
                t.gbps(enc_s),
                memcpy_s / enc_s,
                transfer_s / enc_s,
                t.gbps(enc_checksum_s),
                checksum_s / enc_checksum_s,
                t.connect_s * 1e3,
                e.connect_s * 1e3,
            );
        }
    }

    // Colocated vs disaggregated, same prompt, alternating.
    let ecfg = custody_runtime::EngineConfig {
        context_length: Some(2048),
        kv_budget_mib: 96,
        ..Default::default()
    };
    let prompt: Vec<u32> = (0..a.prompt_tokens as u32)
        .map(|i| 100 + (i * 7919) % (vocab - 200))
        .collect();
    let req = custody_runtime::GenerateRequest {
        decoding: Default::default(),
        prompt: prompt.clone(),
        max_tokens: a.gen_tokens,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: "bench".into(),
        cache: None,
    };
    let mut colo = Engine::new(load()?, ecfg.clone())?;
    let fleet = std::sync::Arc::new(custody_runtime::disagg::tls::Fleet::new(
        "custody bench fleet",
        2,
    )?);
    let opts = PairOptions::loopback(
        &fingerprint,
        UnsafeReproduction::default(),
        Some(fleet.clone()),
    );
    let start = |o: PairOptions| -> Result<Pair> {
        Ok(Pair::start(
            Engine::new(load()?, ecfg.clone())?,
            Engine::new(load()?, ecfg.clone())?,
            o,
        )?)
    };
    // The pair as deployed (mutual TLS, authenticated KV transport), and beside it, alternating:
    // plaintext control plane on loopback (the insecure mode) and KV encryption on.
    let insecure = PairOptions {
        fleet: None,
        ..opts.clone()
    };
    let encrypted = PairOptions {
        transport_encryption: true,
        ..opts.clone()
    };
    let pair = start(opts)?;
    if a.witness || a.witness_only {
        witness_pair_bench(&pair, &req, a.reps)?;
        if a.witness_only {
            return Ok(());
        }
    }
    let colocated = |e: &mut Engine| -> Result<(f64, f64)> {
        let id = e.submit(req.clone())?;
        let t0 = Instant::now();
        let (mut ttft, mut n) = (None, 0usize);
        while e.has_work() {
            for ev in e.step() {
                if let Event::Token { id: r, .. } = ev
                    && r == id
                {
                    ttft.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                    n += 1;
                }
            }
        }
        let total = t0.elapsed().as_secs_f64();
        let ttft = ttft.unwrap_or(total);
        Ok((ttft, (n.saturating_sub(1)) as f64 / (total - ttft)))
    };
    let (insecure, encrypted) = (start(insecure)?, start(encrypted)?);
    let through = |p: &Pair| -> Result<(f64, f64)> {
        let g = p
            .generate(&req)
            .map_err(|s| crate::BenchError::Invalid(s.message().to_owned()))?;
        Ok((
            g.ttft.as_secs_f64(),
            (g.tokens.len() - 1) as f64 / (g.total - g.ttft).as_secs_f64(),
        ))
    };
    let (mut c_ttft, mut c_tps, mut d_ttft, mut d_tps) = (vec![], vec![], vec![], vec![]);
    let (mut i_ttft, mut e_ttft) = (vec![], vec![]);
    for _ in 0..a.reps {
        let (t, r) = colocated(&mut colo)?;
        c_ttft.push(t);
        c_tps.push(r);
        let (t, r) = through(&pair)?;
        d_ttft.push(t);
        d_tps.push(r);
        i_ttft.push(through(&insecure)?.0);
        e_ttft.push(through(&encrypted)?.0);
    }
    drop((insecure, encrypted));
    let (it, et) = (median(i_ttft), median(e_ttft));
    let (ct, cr, dt, dr) = (median(c_ttft), median(c_tps), median(d_ttft), median(d_tps));
    println!(
        "prompt {} tokens, {} generated: time to first token colocated {:.1} ms, disaggregated {:.1} ms ({:.2}x) | decode colocated {:.1} tok/s, disaggregated {:.1} tok/s ({:.2}x)",
        a.prompt_tokens,
        a.gen_tokens,
        ct * 1e3,
        dt * 1e3,
        dt / ct,
        cr,
        dr,
        dr / cr
    );
    println!(
        "time to first token by security, same prompt, alternating: plaintext control plane (insecure_loopback) {:.1} ms | mutual TLS + authenticated KV transport {:.1} ms ({:.3}x) | + transport_encryption {:.1} ms ({:.3}x)",
        it * 1e3,
        dt * 1e3,
        dt / it,
        et * 1e3,
        et / it,
    );
    drop(pair);

    // Release fill: whole requests with fill none / zero / canary, alternating.
    let short = custody_runtime::GenerateRequest {
        decoding: Default::default(),
        max_tokens: 8,
        ..req.clone()
    };
    let mut times: [Vec<f64>; 3] = [vec![], vec![], vec![]];
    for _ in 0..a.reps {
        for (i, fill) in [ReleaseFill::None, ReleaseFill::Zero, ReleaseFill::Canary]
            .into_iter()
            .enumerate()
        {
            colo.set_release_fill(fill);
            let t0 = Instant::now();
            for _ in 0..a.fill_requests {
                colo.submit(short.clone())?;
            }
            while colo.has_work() {
                colo.step();
            }
            times[i].push(t0.elapsed().as_secs_f64());
        }
    }
    let [none, zero, canary] = times.map(median);
    println!(
        "release fill ({} requests of {} + 8 tokens): zero-on-release {:+.2}% time, canary fill {:+.2}% time (vs no fill)",
        a.fill_requests,
        a.prompt_tokens,
        (zero / none - 1.0) * 100.0,
        (canary / none - 1.0) * 100.0
    );
    Ok(())
}

/// The transfer bench's encrypted rig: a decode and a prefill certificate from a fresh fleet.
fn rig_tls() -> Result<custody_runtime::disagg::bench::RigTls> {
    use custody_runtime::disagg::tls::{Fleet, NodeIdentity, Role, Security};
    let fleet = Fleet::new("custody bench fleet", 2)?;
    let (p, d) = (
        NodeIdentity::new(Role::Prefill, 1),
        NodeIdentity::new(Role::Decode, 2),
    );
    let decode = Security::Tls(fleet.node_tls(d, vec![p])?);
    let prefill = Security::Tls(fleet.node_tls(p, vec![d])?);
    Ok(custody_runtime::disagg::bench::RigTls {
        target: decode.kv_encryption(Role::Decode, true)?,
        initiator: prefill.kv_encryption(Role::Prefill, true)?,
    })
}

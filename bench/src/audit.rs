//! `custody audit bench`: writer throughput and bytes per event on a realistic mix.

use std::path::PathBuf;
use std::time::Instant;

use crate::{BenchError, Context, Result};

/// Record `events` (at least; whole batches) of the eBPF witness's rows for 16-page transfers:
/// per page three posted work requests and two completions, in `record_all` batches of 256.
pub fn record_witness_mix(w: &custody_audit::writer::AuditWriter, events: u64) -> Result<u64> {
    use custody_audit::{AuditSink, RdmaOp, RdmaOpRows};
    const BATCH: usize = 256;
    let mut n = 0u64;
    let mut page = 0u64;
    let mut batch = RdmaOpRows::with_capacity(BATCH + 5);
    while n < events {
        page += 1;
        let ts = custody_audit::mono_now_ns();
        let wr_id = ((page / 16) << 16) | (page % 16);
        let base = 0x7f00_0000_0000 + (page % 4096) * 361_536;
        for (i, (off, bytes)) in [(0u64, 175_104u64), (175_104, 175_104), (0, 48)]
            .into_iter()
            .enumerate()
        {
            batch.push(RdmaOp {
                ts_ns: ts,
                ktime_ns: ts + 1_000_000,
                pid: 4242,
                tid: 4243,
                op: "post_write",
                ctx: (1 << 32) | 1,
                wr_id,
                chain_index: i as u32,
                opcode: u32::from(i == 2),
                flags: if i == 2 { 2 } else { 0 },
                imm: (page % 16) as u32,
                remote_addr: base + off,
                rkey: (page / 16) as u32,
                num_sge: if i == 2 { 1 } else { 30 },
                bytes,
                ..RdmaOp::default()
            });
        }
        for (tid, opcode, bytes) in [(4244u32, 1u32, 48u64), (4245, 129, 48)] {
            batch.push(RdmaOp {
                ts_ns: ts + 20_000,
                ktime_ns: ts + 1_020_000,
                pid: 4242,
                tid,
                op: "complete",
                ctx: (2 << 32) | 1,
                wr_id,
                opcode,
                imm: (page % 16) as u32,
                bytes,
                ..RdmaOp::default()
            });
        }
        n += 5;
        if batch.len() >= BATCH {
            w.record_rdma_ops(std::mem::replace(
                &mut batch,
                RdmaOpRows::with_capacity(BATCH + 5),
            ))?;
        }
    }
    w.record_rdma_ops(batch)?;
    Ok(n)
}

/// Record `events` (at least; whole requests) of the realistic per-request mix the audit
/// benchmarks use: lifecycle, 8 page allocs, 28 write-ahead page writes, 8 run-length reads,
/// 8 releases. Returns the number recorded.
pub fn record_mix(w: &custody_audit::writer::AuditWriter, events: u64) -> Result<u64> {
    use custody_audit::{AuditSink, Event, PageKind, RequestKind, Writer};
    let mut n = 0u64;
    let mut req = 0u64;
    let tenants = ["acme", "globex", "initech", "umbrella"];
    while n < events {
        req += 1;
        let tenant: std::sync::Arc<str> = tenants[(req % 4) as usize].into();
        let ts = custody_audit::mono_now_ns();
        let pages: Vec<u32> = (0..8).map(|i| ((req * 8 + i) % 4096) as u32).collect();
        let rec = |ev: Event, n: &mut u64| -> Result<()> {
            w.record(ev).context("recording")?;
            *n += 1;
            Ok(())
        };
        rec(
            Event::Request {
                ts_ns: ts,
                request: req,
                tenant: tenant.clone(),
                kind: RequestKind::Admitted,
                prompt_tokens: 100,
                output_tokens: 0,
            },
            &mut n,
        )?;
        let page_event = |page: u32, ts_ns: u64, kind: PageKind| Event::Page {
            ts_ns,
            request: req,
            tenant: tenant.clone(),
            page,
            generation: (req % 1000) as u32,
            kind,
        };
        for &p in &pages {
            rec(page_event(p, ts, PageKind::Alloc), &mut n)?;
        }
        for step in 0..28u32 {
            let p = pages[(step as usize * 8 / 28).min(7)];
            let kind = PageKind::Write {
                slot_start: step % 16,
                slot_end: step % 16 + 1,
                writer: Writer::Local,
            };
            rec(page_event(p, ts + u64::from(step) * 1000, kind), &mut n)?;
        }
        for &p in &pages {
            rec(
                Event::Read {
                    ts_ns: ts,
                    request: req,
                    tenant: tenant.clone(),
                    page: p,
                    generation: (req % 1000) as u32,
                    slot_start: 0,
                    slot_end: 16,
                    first_step: 1,
                    last_step: 28,
                    verified: true,
                },
                &mut n,
            )?;
            rec(page_event(p, ts, PageKind::Release), &mut n)?;
        }
        rec(
            Event::Request {
                ts_ns: ts,
                request: req,
                tenant: tenant.clone(),
                kind: RequestKind::Finished {
                    reason: "length".into(),
                },
                prompt_tokens: 100,
                output_tokens: 28,
            },
            &mut n,
        )?;
    }
    Ok(n)
}

/// Writer throughput and bytes per event: a realistic mix (per request: lifecycle, page allocs,
/// write-ahead records per step, run-length reads, releases), recorded from one producer thread.
pub fn audit_bench(events: u64, dir: Option<PathBuf>, witness: bool) -> Result<()> {
    use custody_audit::writer::{AuditWriter, FsyncPolicy, WriterConfig};
    let dir = dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("custody-audit-bench-{}", std::process::id()))
    });
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let key = custody_audit::digest::generate_key()?;
    let mut cfg = WriterConfig::new(&dir, 0, key);
    cfg.fsync = FsyncPolicy::Interval(std::time::Duration::from_millis(100));
    if witness {
        // One segment, sealed at the end: the live-segment work and the sealing are measured
        // apart (`writer_live_ns_per_event`, `writer_seal_ns_per_event`).
        cfg.rotate_bytes = u64::MAX;
    }
    let w = AuditWriter::open(cfg)?;
    let t0 = Instant::now();
    let n = if witness {
        record_witness_mix(&w, events)?
    } else {
        record_mix(&w, events)?
    };
    w.sync()?;
    let recorded = t0.elapsed();
    let live_cpu_s = w.writer_cpu_ns() as f64 / 1e9;
    let t_promises = Instant::now();
    let promises = promise_costs(&w)?;
    let promises_took = t_promises.elapsed();
    w.close()?;
    // End to end: recording and sealing, not the promise loop's naps.
    let total = t0.elapsed().saturating_sub(promises_took);
    let writer_cpu_s = w.writer_cpu_ns() as f64 / 1e9;
    let both_cpu_s = writer_cpu_s + w.hasher_cpu_ns() as f64 / 1e9;
    let bytes = crate::parquet_bytes(&dir)?;
    let tlog_bytes = dir_bytes(&dir.join(custody_audit::tree_store::TLOG_DIR))?;
    let proofs = proof_costs(&dir)?;
    let json = serde_json::json!({
        "events": n,
        "record_events_per_s": n as f64 / recorded.as_secs_f64(),
        "sealed_events_per_s": n as f64 / total.as_secs_f64(),
        "writer_thread_cpu_s": writer_cpu_s,
        // With --witness (one segment): the live segment's work and the sealing, apart. Without
        // it, segments rotate every 64 MiB during the run and "live" includes their sealing.
        "writer_live_ns_per_event": live_cpu_s * 1e9 / n as f64,
        "writer_seal_ns_per_event": (writer_cpu_s - live_cpu_s) * 1e9 / n as f64,
        "writer_events_per_cpu_s": if writer_cpu_s > 0.0 { n as f64 / writer_cpu_s } else { 0.0 },
        // The tree's leaves are hashed on a thread of their own: its CPU, and the two together.
        "leaf_hasher_cpu_s": w.hasher_cpu_ns() as f64 / 1e9,
        "writer_and_hasher_events_per_cpu_s": if both_cpu_s > 0.0 { n as f64 / both_cpu_s } else { 0.0 },
        "parquet_bytes": bytes,
        "bytes_per_event": bytes as f64 / n as f64,
        // The Merkle tree (issue 40): the writer thread's time on leaves, hashing, tiles and
        // notes, and the tiles' bytes (32 per record at level 0, plus 1/256 of that above).
        "tree_ns_per_event": w.tree_ns() as f64 / n as f64,
        "tree_share_of_writer_cpu": if writer_cpu_s > 0.0 { w.tree_ns() as f64 / 1e9 / writer_cpu_s } else { 0.0 },
        "tlog_bytes": tlog_bytes,
        "tlog_bytes_per_event": tlog_bytes as f64 / n as f64,
        "proofs": proofs,
        "receipt_promise": promises,
    });
    println!("{json}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// What an answer's receipt promise costs (`AuditWriter::receipt_promise`), from the moment a
/// request's end is recorded to its signed promise in hand: the writer woken from its nap,
/// the rows written (no fsync), the request's leaves taken from its index, the note signed.
/// Requests of 12 records (admission, 10 page events, end), one at a time.
fn promise_costs(w: &custody_audit::writer::AuditWriter) -> Result<serde_json::Value> {
    use custody_audit::writer::PromiseReply;
    use custody_audit::{AuditSink as _, Event, PageKind, RequestKind};
    const REQUESTS: u64 = 200;
    let mut us = Vec::with_capacity(REQUESTS as usize);
    for i in 0..REQUESTS {
        let request = (1 << 40) + i;
        let req = |kind| Event::Request {
            ts_ns: custody_audit::mono_now_ns(),
            request,
            tenant: "bench".into(),
            kind,
            prompt_tokens: 100,
            output_tokens: 20,
        };
        w.record(req(RequestKind::Admitted))?;
        for page in 0..10 {
            w.record(Event::Page {
                ts_ns: custody_audit::mono_now_ns(),
                request,
                tenant: "bench".into(),
                page,
                generation: 1,
                kind: PageKind::Alloc,
            })?;
        }
        // A request seldom ends right after another's promise: let the writer nap first.
        std::thread::sleep(std::time::Duration::from_millis(5));
        w.record(req(RequestKind::Finished {
            reason: "stop".into(),
        }))?;
        let t0 = Instant::now();
        let reply = w.receipt_promise("bench", request)?;
        us.push(t0.elapsed().as_secs_f64() * 1e6);
        match reply {
            PromiseReply::Signed { promise, .. } if promise.leaves.len() == 12 => {}
            other => {
                return Err(BenchError::Invalid(format!(
                    "request {request}'s promise: {other:?}"
                )));
            }
        }
    }
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q) as usize];
    Ok(serde_json::json!({
        "requests": REQUESTS,
        "records_each": 12,
        "p50_us": at(0.5),
        "p99_us": at(0.99),
        "max_us": at(1.0),
    }))
}

/// What proofs from the sealed root cost (node 0): an inclusion proof with the level-0 tiles
/// recomputed from the records (the default), the same once `audit tiles` wrote them, a
/// record's canonical bytes, and a consistency proof from the first sealed size.
fn proof_costs(dir: &std::path::Path) -> Result<serde_json::Value> {
    use custody_audit::tree_store::{self, NodeLog};
    const PROOFS: u64 = 20;
    let store = custody_audit::digest::LocalStore::new(dir);
    let time_proofs = |log: &NodeLog<'_>, size: u64| -> Result<f64> {
        let t0 = Instant::now();
        for i in 0..PROOFS {
            let seq = (size - 1) * i / (PROOFS - 1);
            let p = log.prove_inclusion(seq, size).context("inclusion proof")?;
            assert!(p.len() <= 64);
        }
        Ok(t0.elapsed().as_secs_f64() * 1e3 / PROOFS as f64)
    };
    let log = NodeLog::open(&store, 0).context("the bench's log")?;
    let note = log.checkpoint_note().context("the bench's checkpoint")?;
    let size = custody_audit::tlog::note_checkpoint(&note)
        .map_err(|e| BenchError::Invalid(format!("the bench's checkpoint: {e}")))?
        .size();
    let from_records_ms = time_proofs(&log, size)?;
    // A receipt's case: many records of one request, close together in one segment (the
    // segment's leaves are recomputed once, then cached).
    let t0 = Instant::now();
    for i in 0..PROOFS {
        let p = log
            .prove_inclusion(size / 3 + i * 37, size)
            .context("inclusion proof")?;
        assert!(p.len() <= 64);
    }
    let same_segment_ms = t0.elapsed().as_secs_f64() * 1e3 / PROOFS as f64;
    let t0 = Instant::now();
    for i in 0..PROOFS {
        log.record((size - 1) * i / (PROOFS - 1))
            .context("a record's bytes")?;
    }
    let record_ms = t0.elapsed().as_secs_f64() * 1e3 / PROOFS as f64;
    let first = std::fs::read_dir(dir.join("_digests/node=0"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .min()
        .ok_or_else(|| BenchError::Invalid("no digest".into()))?;
    let d: custody_audit::digest::DigestFile = serde_json::from_slice(&std::fs::read(&first)?)?;
    let old = d.body.tree_size.unwrap_or(size);
    let t0 = Instant::now();
    let c = log
        .prove_consistency(old, size)
        .context("consistency proof")?;
    let consistency_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    tree_store::rebuild(dir, 0).context("audit tiles")?;
    let tiles_s = t0.elapsed().as_secs_f64();
    let log = NodeLog::open(&store, 0).context("the bench's log")?;
    let from_tiles_ms = time_proofs(&log, size)?;
    Ok(serde_json::json!({
        "tree_size": size,
        "inclusion_proof_ms_level0_from_records": from_records_ms,
        "inclusion_proof_ms_level0_from_records_same_segment": same_segment_ms,
        "inclusion_proof_ms_level0_from_tiles": from_tiles_ms,
        "record_bytes_ms": record_ms,
        "consistency_proof_ms": consistency_ms,
        "consistency_proof_hashes": c.len(),
        "audit_tiles_s": tiles_s,
    }))
}

/// Bytes of every file under `dir` (0 if there is none).
fn dir_bytes(dir: &std::path::Path) -> std::io::Result<u64> {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    // Bounded by the tree's depth (tile/<L>/x…/<N>.p/<W>): a handful of levels.
    while let Some(d) = stack.pop() {
        let rd = match std::fs::read_dir(&d) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for e in rd {
            let e = e?;
            let m = e.metadata()?;
            if m.is_dir() {
                stack.push(e.path());
            } else {
                total += m.len();
            }
        }
    }
    Ok(total)
}

//! Custody's eBPF witness: an observer of the KV transfer path that does not trust the engine.
//!
//! - `bpf/witness.bpf.c`: the BPF programs (C, compiled by `build.rs` with clang for the `bpf`
//!   target). Uprobes on the transport's four probe points decode work-request chains (opcode,
//!   wr_id, scatter/gather entries, remote address and key, immediate data) with bounded loops,
//!   completions (wr_id, status, bytes), registrations and invalidations; uprobes/uretprobes on
//!   libibverbs' control path (`ibv_reg_mr`, `ibv_dereg_mr`, `ibv_create_qp`, `ibv_modify_qp`,
//!   `ibv_destroy_qp`). One ring buffer with batched wake-ups; per-CPU lost-event counters.
//! - [`witness`]: the aya loader — attach points from configuration (`configs/witness.toml`:
//!   program, binary, symbol), symbols resolved version-aware ([`symbols`]) and attached by
//!   file offset; reading the ring buffer and the counters.
//! - [`event`]: the record layout (mirrors `struct event`) and its audit row.
//! - [`collector`]: ring buffer → `rdma_ops` / `rdma_mr` rows through the audit writer, lost
//!   events → `node_events` rows (reported, never silent).
//!
//! Architecture invariant: this crate knows the transport only through its probe ABI
//! (`custody-probe-abi`: C layouts and symbol names), never its code; it does not
//! depend on `custody-runtime`.

pub mod collector;
pub mod event;
pub mod symbols;
pub mod witness;

pub use collector::{ClockMap, CollectError, CollectStats};
pub use event::{Kind, Observation};
pub use witness::{
    AttachSpec, Attached, BpfStats, Lost, ProgramStats, Target, Witness, WitnessConfig,
    WitnessError, check_permitted,
};

/// For tests of anything that needs BPF: `true` when the witness can run here; otherwise the
/// reason, printed loudly and counted in the suite's skip log (`custody_test_skip`) — and a
/// panic when `CI=true`, so that CI never passes a witness test that did not run.
pub fn require_bpf_or_skip(test: &str) -> bool {
    match check_permitted() {
        Ok(()) => true,
        Err(e) => {
            // Counted in the suite's skip log; a failure under CI=true (CI runs as root).
            custody_test_skip::skip(
                test,
                &format!("BPF not permitted: {e}"),
                custody_test_skip::Need::OnCi,
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    //! The witness against probe points with the transport's ABI, defined here (this crate does
    //! not link the runtime): chains decoded field by field, bounds counted as lost.
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    // The probe points and layouts are the transport's own (`custody-probe-abi`).
    use custody_probe_abi::{
        SendWr, Sge, Wc, custody_kv_complete, custody_kv_invalidate, custody_kv_post_write,
        custody_kv_register,
    };

    /// The BPF tests of this binary attach to the same probe points, and every witness sees
    /// every hit in the process: one at a time, so that no test's records land in another's
    /// ring (its counts, its wake-up threshold).
    static BPF_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// IRQ work interrupts so far, all CPUs (`/proc/interrupts`, `IWI`): a ring-buffer wake-up
    /// is one.
    fn irq_work_interrupts() -> Option<u64> {
        let s = std::fs::read_to_string("/proc/interrupts").ok()?;
        let line = s.lines().find(|l| l.trim_start().starts_with("IWI:"))?;
        Some(
            line.split_whitespace()
                .skip(1)
                .map_while(|x| x.parse::<u64>().ok())
                .sum(),
        )
    }

    /// Wake-ups are batched: records under the threshold do not wake a waiting collector, the
    /// record that crosses it does, and past it the collector is woken once per threshold's
    /// worth of records — not once per record (each wake-up is an irq_work interrupt).
    #[test]
    fn the_collector_is_woken_at_each_threshold_not_by_each_record() {
        if !require_bpf_or_skip("ebpf::wake_ups_are_batched") {
            return;
        }
        let _one_at_a_time = BPF_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        const THRESHOLD: u64 = 8192;
        let mut cfg = WitnessConfig::default_config();
        cfg.wakeup_threshold_bytes = THRESHOLD;
        let mut w = Witness::attach(&cfg, &Target::Pid(std::process::id())).expect("attach");
        let ctx = (9u64 << 32) | 1;
        // 1. Ten records (≈ 1 KiB) do not wake a waiting collector; crossing the threshold does.
        let producer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            for i in 0..10 {
                custody_kv_register(ctx, i, 0, 0);
            }
            std::thread::sleep(Duration::from_millis(700));
            for i in 0..200 {
                custody_kv_register(ctx, 100 + i, 0, 0);
            }
        });
        let t0 = std::time::Instant::now();
        let mut seen = 0usize;
        w.poll(Duration::from_secs(10), 100_000, |o| {
            seen += usize::from(o.ctx == ctx);
        })
        .expect("poll");
        let woke = t0.elapsed();
        producer.join().expect("producer");
        assert!(
            woke >= Duration::from_millis(900),
            "woken after {woke:?}: by records under the threshold"
        );
        assert!(
            woke < Duration::from_secs(5),
            "not woken by crossing the threshold ({woke:?})"
        );
        while seen < 210 {
            let n = w
                .poll(Duration::from_millis(100), 100_000, |o| {
                    seen += usize::from(o.ctx == ctx);
                })
                .expect("poll");
            if n == 0 {
                break;
            }
        }
        assert_eq!(seen, 210, "every record arrives");

        // 2. Far past the threshold, with nobody reading: one wake-up per threshold's worth.
        const RECORDS: u64 = 5000; // 104 B each with its header: ~63 thresholds' worth
        let Some(before) = irq_work_interrupts() else {
            custody_test_skip::skip(
                "ebpf::wake_ups_are_batched (part 2)",
                "no IWI line in /proc/interrupts",
                custody_test_skip::Need::OnCi,
            );
            return;
        };
        for i in 0..RECORDS {
            custody_kv_register(ctx, 1000 + i as u32, 0, 0);
        }
        let after = irq_work_interrupts().expect("IWI");
        let expected = RECORDS * 104 / THRESHOLD;
        assert!(
            after - before < 4 * expected + 100,
            "{} irq_work interrupts for {RECORDS} records ({expected} thresholds' worth): a wake-up per record?",
            after - before
        );
        let mut drained = 0u64;
        while w
            .poll(Duration::ZERO, 100_000, |o| {
                drained += u64::from(o.ctx == ctx);
            })
            .expect("poll")
            > 0
        {}
        assert_eq!(drained, RECORDS);
        assert_eq!(w.lost().expect("lost").total(), 0);
    }

    fn chain(n_wrs: usize, sges_per_wr: usize, sges: &[Sge]) -> Vec<SendWr> {
        let mut wrs: Vec<SendWr> = (0..n_wrs)
            .map(|i| {
                let mut wr = SendWr::rdma_write(
                    0x5000 + i as u64,
                    &sges[..sges_per_wr.min(sges.len())],
                    0x10_0000 + 4096 * i as u64,
                    77,
                );
                // `num_sge` as asked, even past the slice (the witness's SGE bound is tested).
                wr.num_sge = sges_per_wr as i32;
                wr.opcode = u32::from(i + 1 == n_wrs);
                wr.send_flags = if i + 1 == n_wrs { 2 } else { 0 };
                wr.imm_data = (0x0102_0304u32 + i as u32).to_be();
                wr
            })
            .collect();
        for i in 0..n_wrs.saturating_sub(1) {
            let next: *const SendWr = &wrs[i + 1];
            wrs[i].next = next;
        }
        wrs
    }

    #[test]
    fn witness_decodes_chains_and_counts_what_its_bounds_cut() {
        if !require_bpf_or_skip("ebpf::witness_decodes_chains") {
            return;
        }
        let _one_at_a_time = BPF_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let mut cfg = WitnessConfig::default_config();
        cfg.record_sges = true;
        let mut w = Witness::attach(&cfg, &Target::Pid(std::process::id()))
            .expect("attach to this test process");
        assert_eq!(w.attached().len(), 4, "{:?}", w.attached());

        let sges: Vec<Sge> = (0..40)
            .map(|i| Sge {
                addr: 0x7000_0000 + 0x100 * i,
                length: 100 + i as u32,
                lkey: 3,
            })
            .collect();
        let ctx = (2u64 << 32) | 5;
        let small = chain(3, 2, &sges);
        custody_kv_register(ctx, 77, 0x10_0000, 1 << 20);
        custody_kv_post_write(ctx, &small[0]);
        let wcs: Vec<Wc> = (0..300u32)
            .map(|i| {
                let mut wc = Wc::new(0x5002 + u64::from(i), i % 2, 1, 201 + i, 9 + i);
                wc.qp_num = 12;
                wc
            })
            .collect();
        // A batch of three completions: one probe hit, one record each.
        custody_kv_complete(ctx, wcs.as_ptr(), 3);
        // 40 SGEs in one request (bound 30), a chain of 4100 (bound 4096) and a batch of 300
        // completions (bound 256): what the bounds cut is counted as lost.
        let wide = chain(1, 40, &sges);
        custody_kv_post_write(ctx, &wide[0]);
        let long = chain(4100, 1, &sges);
        custody_kv_post_write(ctx, &long[0]);
        custody_kv_complete(ctx, wcs.as_ptr(), 300);
        custody_kv_invalidate(ctx, 77);

        // register, 3 writes, 3 completions, the wide write, 4096 of the long chain, 256 of the
        // long batch, invalidate.
        const EXPECTED: usize = 1 + 3 + 3 + 1 + 4096 + 256 + 1;
        let mut seen = Vec::new();
        for _ in 0..50 {
            // Other tests of this binary may hit the probe points concurrently: only ours.
            w.poll(std::time::Duration::from_millis(20), 10_000, |o| {
                if o.ctx == ctx {
                    seen.push(o)
                }
            })
            .expect("poll");
            if seen.len() >= EXPECTED {
                break;
            }
        }
        assert_eq!(seen.len(), EXPECTED, "every record arrives");
        assert_eq!(seen[0].kind, Kind::Register);
        assert_eq!(
            (seen[0].rkey, seen[0].addr, seen[0].bytes),
            (77, 0x10_0000, 1 << 20)
        );
        for (i, o) in seen[1..4].iter().enumerate() {
            assert_eq!(o.kind, Kind::PostWrite);
            assert_eq!(o.pid, std::process::id());
            assert_eq!(o.ctx, ctx);
            assert_eq!(o.wr_id, 0x5000 + i as u64);
            assert_eq!(o.chain_index, i as u32);
            assert_eq!(o.rkey, 77);
            assert_eq!(o.addr, 0x10_0000 + 4096 * i as u64);
            assert_eq!(o.num_sge, 2);
            assert_eq!(o.bytes, 100 + 101);
            assert_eq!(o.sges.len(), 2);
            assert_eq!(o.sges[1].addr, 0x7000_0100);
            assert_eq!(u32::from_be(o.imm_be), 0x0102_0304 + i as u32);
        }
        assert_eq!((seen[3].opcode, seen[3].send_flags), (1, 2));
        for (i, o) in seen[4..7].iter().enumerate() {
            assert_eq!(o.kind, Kind::Complete);
            assert_eq!(
                (o.ctx, o.wr_id, o.status, o.bytes, o.qp_num, o.chain_index),
                (
                    ctx,
                    0x5002 + i as u64,
                    i as i32 % 2,
                    201 + i as u64,
                    12,
                    i as u32
                )
            );
            assert_eq!(u32::from_be(o.imm_be), 9 + i as u32);
        }
        let wide_o = &seen[7];
        assert_eq!((wide_o.num_sge, wide_o.sges.len()), (40, 30));
        assert_ne!(wide_o.flags & event::F_SGE_TRUNCATED, 0);
        assert_eq!(wide_o.bytes, (100..130).sum::<u64>());
        assert!(seen[8..8 + 4096].iter().all(|o| o.kind == Kind::PostWrite));
        assert_eq!(seen[8 + 4095].chain_index, 4095);
        let batch = &seen[8 + 4096..8 + 4096 + 256];
        assert!(batch.iter().all(|o| o.kind == Kind::Complete));
        assert_eq!(
            (batch[255].wr_id, batch[255].chain_index),
            (0x5002 + 255, 255)
        );
        assert_eq!(seen[8 + 4096 + 256].kind, Kind::Invalidate);
        let lost = w.lost().expect("lost counters");
        assert_eq!(lost.sge_truncated, 1);
        assert_eq!(lost.chain_truncated, 2, "the long chain and the long batch");
        assert_eq!(lost.ring_full, 0);

        // And the collector turns them into audit rows.
        custody_kv_invalidate(ctx, 78);
        let sink = custody_audit::MemorySink::default();
        let stop = AtomicBool::new(true);
        let stats = collector::run(&mut w, &sink, &stop, std::time::Duration::from_millis(1))
            .expect("collect");
        assert_eq!(stats.registrations, 1);
        assert_eq!(stats.lost.chain_truncated, 2);
        let events = sink.events.lock().expect("events");
        assert!(events.iter().any(
            |e| matches!(e, custody_audit::Event::RdmaMr(m) if m.rkey == 78 && m.op == "invalidate")
        ));
        assert!(events.iter().any(
            |e| matches!(e, custody_audit::Event::Node { kind, .. } if kind == "witness_lost")
        ));
    }

    /// The libibverbs control-path programs pass the verifier and attach by file offset to the
    /// default symbol versions of the installed library (no RDMA device here, so none fires).
    #[test]
    fn libibverbs_programs_load_and_attach_by_offset() {
        if !require_bpf_or_skip("ebpf::libibverbs_programs_load_and_attach") {
            return;
        }
        let _one_at_a_time = BPF_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let Some(lib) = symbols::find_library("libibverbs.so.1") else {
            custody_test_skip::skip(
                "ebpf::libibverbs_programs_load_and_attach_by_offset",
                "libibverbs.so.1 is not installed (scripts/setup.sh installs it)",
                custody_test_skip::Need::OnCi,
            );
            return;
        };
        let mut cfg = WitnessConfig::default_config();
        cfg.attach.retain(|a| a.binary != "@target");
        assert_eq!(cfg.attach.len(), 7);
        let exe = std::env::current_exe().expect("exe");
        let w = Witness::attach(&cfg, &Target::Binary(exe)).expect("attach to libibverbs");
        assert_eq!(w.attached().len(), 7);
        for a in w.attached() {
            assert_eq!(a.binary, lib);
            assert_eq!(a.version.as_deref(), Some("IBVERBS_1.1"), "{a:?}");
            let def = symbols::resolve(&lib, &a.symbol).expect("resolve");
            assert_eq!(a.file_offset, def.file_offset);
        }
    }

    /// Without `record_sges` (the default) a post's requests travel in batch records (a header
    /// and up to 8 entries): every request decoded field by field across records, its SGE count
    /// and total length (not the entries), and the chain bound still counted.
    #[test]
    fn witness_batches_a_posts_requests_and_still_sums_the_lengths() {
        if !require_bpf_or_skip("ebpf::witness_batches_posts") {
            return;
        }
        let _one_at_a_time = BPF_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let mut w = Witness::attach(
            &WitnessConfig::default_config(),
            &Target::Pid(std::process::id()),
        )
        .expect("attach");
        let sges: Vec<Sge> = (0..12)
            .map(|i| Sge {
                addr: 0x9000_0000 + 0x100 * i,
                length: 10 + i as u32,
                lkey: 1,
            })
            .collect();
        let ctx = (4u64 << 32) | 1;
        // 20 requests of 12 SGEs (more than one 8-SGE read each): three batch records.
        let c = chain(20, 12, &sges);
        custody_kv_post_write(ctx, &c[0]);
        // A chain past the bound (4096): what it cuts is counted.
        let long = chain(4100, 1, &sges);
        custody_kv_post_write(ctx, &long[0]);
        let mut seen = Vec::new();
        let mut records = 0;
        for _ in 0..50 {
            records += w
                .poll(std::time::Duration::from_millis(20), 10_000, |o| {
                    if o.ctx == ctx {
                        seen.push(o)
                    }
                })
                .expect("poll");
            if seen.len() >= 20 + 4096 {
                break;
            }
        }
        assert_eq!(seen.len(), 20 + 4096, "every request arrives");
        assert!(records < 20 + 4096, "batched: {records} records");
        let total: u64 = (10..22).sum();
        for (i, o) in seen[..20].iter().enumerate() {
            assert_eq!(o.kind, Kind::PostWrite);
            assert_eq!((o.pid, o.ctx), (std::process::id(), ctx));
            assert_eq!((o.wr_id, o.chain_index), (0x5000 + i as u64, i as u32));
            assert_eq!((o.rkey, o.addr), (77, 0x10_0000 + 4096 * i as u64));
            assert_eq!((o.num_sge, o.bytes, o.flags), (12, total, 0));
            assert_eq!(u32::from_be(o.imm_be), 0x0102_0304 + i as u32);
            let last = i == 19;
            assert_eq!(
                (o.opcode, o.send_flags),
                (u32::from(last), if last { 2 } else { 0 })
            );
            assert!(o.sges.is_empty());
        }
        assert!(
            seen[..20].iter().all(|o| o.ktime_ns == seen[0].ktime_ns),
            "one post"
        );
        assert_eq!(seen[20 + 4095].chain_index, 4095);
        assert_eq!(w.lost().expect("lost").chain_truncated, 1);
    }
}

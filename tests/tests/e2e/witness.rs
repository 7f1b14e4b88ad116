//! The eBPF witness against a running disaggregated pair (in-process: real gRPC, the tcp KV
//! transport on loopback; its probe points fire for tcp as they would for verbs): it sees exactly
//! the transfers the engine recorded, and it alone catches two injected engine faults.
//!
//! These tests need BPF (root, a uprobe PMU). Where it is not permitted they say so loudly and
//! skip — and fail under `CI=true` (`custody_ebpf::require_bpf_or_skip`).
//!
//! Other tests of this binary may run pairs concurrently in the same process, and the witness
//! watches the whole process: each test uses its own node ids and audit root, and looks only at
//! the writes of its own prefill node (`ctx >> 32`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use custody_audit::AuditSink;
use custody_audit::writer::{AuditWriter, WriterConfig};
use custody_ebpf::{Target, Witness, WitnessConfig, collector};
use custody_query::forensics::{Crosscheck, crosscheck};
use custody_runtime::Engine;
use custody_runtime::config::UnsafeReproduction;
use custody_runtime::disagg::client::{Pair, PairOptions};
use custody_runtime::disagg::prefill::PrefillFault;
use custody_runtime::transport::TransportKind;

use crate::disagg::{Tee, cfg, fingerprint, model, req};

/// A pair whose nodes record into `root` (prefill `node`, decode `node + 1`), a witness attached
/// to this process recording as node `node + 2`, and its collector thread.
struct Rig {
    pair: Option<Pair>,
    writers: Vec<Arc<AuditWriter>>,
    stop: Arc<AtomicBool>,
    collector: Option<std::thread::JoinHandle<collector::CollectStats>>,
    root: std::path::PathBuf,
    key: ed25519_dalek::SigningKey,
    node: u32,
}

impl Rig {
    fn start(name: &str, node: u32) -> Self {
        let root =
            std::env::temp_dir().join(format!("custody-witness-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let key = custody_audit::digest::generate_key().expect("key");
        let open = |n: u32| {
            Arc::new(AuditWriter::open(WriterConfig::new(&root, n, key.clone())).expect("writer"))
        };
        let (pw, dw, ww) = (open(node), open(node + 1), open(node + 2));

        // The witness first, so it sees the pair from its first registration.
        // A large ring: the witness sees every pair in this process, including other tests'.
        let mut wcfg = WitnessConfig::default_config();
        wcfg.ring_buffer_bytes = 64 << 20;
        let mut witness =
            Witness::attach(&wcfg, &Target::Pid(std::process::id())).expect("witness attaches");
        assert_eq!(witness.attached().len(), 4, "{:?}", witness.attached());
        collector::record_start(&witness, "this test process", &*ww).expect("start row");
        let stop = Arc::new(AtomicBool::new(false));
        let (s, w) = (stop.clone(), ww.clone());
        let interval = wcfg.poll_interval();
        let collector = std::thread::spawn(move || {
            collector::run(&mut witness, &*w, &s, interval).expect("collector")
        });

        let (pa, da) = (
            custody_audit::MemorySink::default(),
            custody_audit::MemorySink::default(),
        );
        let pe = Engine::new(model(), cfg(2048, 64))
            .expect("prefill engine")
            .with_audit(Arc::new(Tee(pa, Some(pw.clone() as Arc<dyn AuditSink>))));
        let de = Engine::new(model(), cfg(2048, 64))
            .expect("decode engine")
            .with_audit(Arc::new(Tee(da, Some(dw.clone() as Arc<dyn AuditSink>))));
        let mut opts = PairOptions::loopback(
            &fingerprint(),
            UnsafeReproduction::default(),
            Some(crate::disagg::fleet()),
        );
        opts.prefill.node_id = node;
        opts.decode.node_id = node + 1;
        opts.prefill.transport_kind = TransportKind::Tcp;
        opts.decode.transport_kind = TransportKind::Tcp;
        let pair = Pair::start(pe, de, opts).expect("pair starts");
        Self {
            pair: Some(pair),
            writers: vec![pw, dw, ww],
            stop,
            collector: Some(collector),
            root,
            key,
            node,
        }
    }

    fn pair(&self) -> &Pair {
        self.pair.as_ref().expect("running")
    }

    /// Stop the pair and the witness, seal every log, and cross-check the verified files.
    /// Returns the cross-check restricted to this rig's prefill node, and its witness's stats.
    fn finish(mut self) -> (Crosscheck, collector::CollectStats, Counts) {
        drop(self.pair.take());
        self.stop.store(true, Ordering::Release);
        let stats = self
            .collector
            .take()
            .expect("collector")
            .join()
            .expect("collector thread");
        for w in &self.writers {
            w.close().expect("seal");
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt");
        let node = self.node;
        let (mut cc, counts) = rt.block_on(async {
            let vs = custody_query::session_over_verified(&self.root, Some(&self.key.verifying_key()))
                .await
                .expect("session");
            assert!(vs.report.problems.is_empty(), "{:?}", vs.report.problems);
            custody_query::prepare_forensics(&vs.ctx)
                .await
                .expect("prepare");
            let cc = crosscheck(&vs.ctx).await.expect("crosscheck");
            let n = |sql: String| {
                let ctx = vs.ctx.clone();
                async move {
                    let b = ctx.sql(&sql).await.expect("sql").collect().await.expect("rows");
                    datafusion_i64(&b)
                }
            };
            let counts = Counts {
                observed_writes: n(format!(
                    "SELECT COUNT(*) FROM all_rdma_ops WHERE op = 'post_write' AND ctx / 4294967296 = {node}"
                ))
                .await,
                engine_writes: n(format!(
                    "SELECT CAST(COALESCE(SUM(work_requests), 0) AS BIGINT) FROM all_transfers WHERE node_id = {node} AND src_node = {node}"
                ))
                .await,
                engine_transfers: n(format!(
                    "SELECT COUNT(*) FROM all_transfers WHERE node_id = {node} AND src_node = {node}"
                ))
                .await,
                registrations: n(format!(
                    "SELECT COUNT(*) FROM all_rdma_mr WHERE op = 'register' AND ctx / 4294967296 = {}",
                    node + 1
                ))
                .await,
                invalidations: n(format!(
                    "SELECT COUNT(*) FROM all_rdma_mr WHERE op = 'invalidate' AND ctx / 4294967296 = {}",
                    node + 1
                ))
                .await,
                completions: n(format!(
                    "SELECT COUNT(*) FROM all_rdma_ops WHERE op = 'complete' AND ctx / 4294967296 = {node}"
                ))
                .await,
                // Every observed write's wr_id and bytes, and the engine's, compared as sets.
                mismatched_rows: n(format!(
                    "WITH o AS (SELECT wr_id, SUM(bytes) AS b, COUNT(*) AS n FROM all_rdma_ops
                                WHERE op = 'post_write' AND ctx / 4294967296 = {node} GROUP BY wr_id),
                          e AS (SELECT transfer_id AS wr_id, wire_bytes AS b, work_requests AS n FROM all_transfers
                                WHERE node_id = {node} AND src_node = {node})
                     SELECT COUNT(*) FROM o FULL OUTER JOIN e ON o.wr_id = e.wr_id
                     WHERE o.wr_id IS NULL OR e.wr_id IS NULL OR o.b <> e.b OR o.n <> e.n"
                ))
                .await,
            };
            (cc, counts)
        });
        cc.discrepancies.retain(|d| d.src_node == i64::from(node));
        let _ = std::fs::remove_dir_all(&self.root);
        (cc, stats, counts)
    }
}

#[derive(Debug)]
struct Counts {
    observed_writes: i64,
    engine_writes: i64,
    engine_transfers: i64,
    registrations: i64,
    invalidations: i64,
    completions: i64,
    mismatched_rows: i64,
}

fn datafusion_i64(b: &[arrow::array::RecordBatch]) -> i64 {
    use arrow::array::AsArray;
    let b = b.first().expect("one row");
    arrow::compute::cast(b.column(0), &arrow::datatypes::DataType::Int64)
        .expect("an integer")
        .as_primitive::<arrow::datatypes::Int64Type>()
        .value(0)
}

fn prompt(len: u32, salt: u32) -> Vec<u32> {
    (0..len)
        .map(|i| 1000 + (i * 37 + salt * 101) % 5000)
        .collect()
}

#[test]
fn witness_sees_exactly_the_transfers_the_engine_recorded() {
    if !custody_ebpf::require_bpf_or_skip("e2e::witness::exactly_the_transfers") {
        return;
    }
    let rig = Rig::start("exact", 301);
    // Full and partial pages, several tenants, concurrently, then one more alone.
    let reqs = vec![
        req("acme", prompt(40, 1), 4),
        req("globex", prompt(16, 2), 4),
        req("initech", prompt(70, 3), 4),
        req("umbrella", prompt(5, 4), 4),
    ];
    for r in rig.pair().generate_many(&reqs) {
        r.expect("served");
    }
    rig.pair()
        .generate(&req("acme", prompt(33, 5), 4))
        .expect("served");
    let (cc, stats, counts) = rig.finish();
    eprintln!("witness: {stats:?}\n{counts:?}\n{}", cc.summary());
    // Pages: 3 + 1 + 5 + 1 + 3.
    assert_eq!(counts.engine_transfers, 13, "{counts:?}");
    assert!(counts.engine_writes >= counts.engine_transfers);
    assert_eq!(counts.observed_writes, counts.engine_writes, "{counts:?}");
    assert_eq!(counts.mismatched_rows, 0, "{counts:?}");
    assert_eq!(
        counts.completions, counts.engine_transfers,
        "one signaled write per page"
    );
    assert_eq!(counts.registrations, 5, "one key per reservation");
    assert_eq!(counts.invalidations, 5, "every key invalidated at hand-off");
    assert_eq!(stats.lost.total(), 0, "{stats:?}");
    assert!(
        cc.discrepancies.is_empty(),
        "the witness and the engine disagree:\n{:#?}",
        cc.discrepancies
    );
}

#[test]
fn witness_alone_catches_a_phantom_write_the_engine_did_not_record() {
    if !custody_ebpf::require_bpf_or_skip("e2e::witness::phantom_write") {
        return;
    }
    let rig = Rig::start("phantom", 311);
    rig.pair().prefill.fault_inject(PrefillFault::PhantomWrite);
    let out = rig
        .pair()
        .generate(&req("acme", prompt(40, 7), 4))
        .expect("served: the engine noticed nothing");
    assert_eq!(out.tokens.len(), 4);
    let stats = rig.pair().decode.stats_blocking().expect("stats");
    assert_eq!(stats.verify_failures, 0, "decode's own checks pass");
    let (cc, _, counts) = rig.finish();
    eprintln!("{counts:?}\n{:#?}", cc.discrepancies);
    // The engine's record is consistent with itself: every recorded transfer has its writes.
    assert_eq!(counts.engine_transfers, 3);
    assert_eq!(counts.observed_writes, counts.engine_writes + 1);
    assert_eq!(cc.discrepancies.len(), 1, "{:#?}", cc.discrepancies);
    let d = &cc.discrepancies[0];
    assert_eq!(d.kind, "unrecorded_write");
    assert_eq!(d.wr_id & 0xffff, 0xffff);
    assert_eq!(d.engine, "no transfer with this wr_id");
    assert!(d.witness.contains("landed in page"), "{d:?}");
    assert!(d.witness.contains("(acme)"), "{d:?}");
}

#[test]
fn witness_alone_catches_a_stale_write_into_a_reallocated_page() {
    if !custody_ebpf::require_bpf_or_skip("e2e::witness::stale_write") {
        return;
    }
    let rig = Rig::start("stale", 321);
    rig.pair().prefill.fault_inject(PrefillFault::StaleWrite);
    // A's transfer is remembered; once A is done its decode pages are freed and B gets them.
    rig.pair()
        .generate(&req("acme", prompt(40, 8), 4))
        .expect("A served");
    let t0 = std::time::Instant::now();
    while rig
        .pair()
        .decode
        .stats_blocking()
        .expect("stats")
        .live_requests
        > 0
    {
        assert!(t0.elapsed() < Duration::from_secs(10), "A never released");
        std::thread::sleep(Duration::from_millis(10));
    }
    let b = rig
        .pair()
        .generate(&req("globex", prompt(40, 9), 4))
        .expect("B served: the engine noticed nothing");
    assert_eq!(b.tokens.len(), 4);
    assert_eq!(
        rig.pair()
            .decode
            .stats_blocking()
            .expect("stats")
            .verify_failures,
        0
    );
    let (cc, _, counts) = rig.finish();
    eprintln!("{counts:?}\n{:#?}", cc.discrepancies);
    assert_eq!(counts.engine_transfers, 6);
    assert_eq!(counts.observed_writes, counts.engine_writes + 1);
    let stale: Vec<_> = cc
        .discrepancies
        .iter()
        .filter(|d| d.kind == "stale_write")
        .collect();
    assert_eq!(stale.len(), 1, "{:#?}", cc.discrepancies);
    let d = stale[0];
    assert!(
        d.engine.contains("(acme)"),
        "the write is A's per the engine: {d:?}"
    );
    assert!(
        d.witness.contains("(globex)"),
        "it landed in B's page: {d:?}"
    );
    // The same write also breaks A's transfer (one write more than its chain, outside it).
    assert!(
        cc.discrepancies
            .iter()
            .all(|x| x.kind == "stale_write"
                || (x.kind == "transfer_mismatch" && x.wr_id == d.wr_id)),
        "{:#?}",
        cc.discrepancies
    );
}

//! The audit log end to end: engine events from Parquet alone, independent readers, tamper
//! evidence, crash recovery (a real `kill -9`), and disk full.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{UInt32Type, UInt64Type};
use custody_audit::digest::{self, Problem};
use custody_audit::writer::{AuditWriter, WriterConfig};
use custody_audit::{AuditSink, Event as AEvent, PageKind};
use custody_runtime::SamplingParams;
use custody_runtime::engine::{Event, GenerateRequest};

use crate::{engine_with, small_cfg, tokenizer};

/// A fresh directory under the temp dir, removed when the guard drops — unless the test is
/// failing (panicking), when it is kept for the post-mortem and its path printed.
pub(crate) fn tmp_dir(name: &str) -> TmpDir {
    let d = std::env::temp_dir().join(format!("custody-audit-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("mkdir");
    TmpDir(d)
}

/// See [`tmp_dir`]: derefs to its path.
#[derive(Debug)]
pub(crate) struct TmpDir(PathBuf);

impl std::ops::Deref for TmpDir {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl AsRef<Path> for TmpDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TmpDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept for inspection: {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub(crate) fn key() -> ed25519_dalek_key::Key {
    ed25519_dalek_key::Key(digest::generate_key().expect("key"))
}

pub(crate) mod ed25519_dalek_key {
    pub struct Key(pub ed25519_dalek::SigningKey);
}

/// All rows of one table under `root`, read back with the `parquet` crate.
pub fn read_table(root: &Path, table: &str) -> Vec<RecordBatch> {
    let mut files = Vec::new();
    let mut stack = vec![root.join(table)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
        .iter()
        .flat_map(|f| {
            let file = std::fs::File::open(f).expect("open");
            parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                .expect("parquet")
                .build()
                .expect("reader")
                .map(|b| b.expect("batch"))
                .collect::<Vec<_>>()
        })
        .collect()
}

pub(crate) fn col_u64(b: &RecordBatch, name: &str) -> Vec<u64> {
    b.column_by_name(name)
        .expect(name)
        .as_primitive::<UInt64Type>()
        .values()
        .to_vec()
}
pub(crate) fn col_u32(b: &RecordBatch, name: &str) -> Vec<Option<u32>> {
    let a = b
        .column_by_name(name)
        .expect(name)
        .as_primitive::<UInt32Type>();
    (0..a.len())
        .map(|i| a.is_valid(i).then(|| a.value(i)))
        .collect()
}
pub(crate) fn col_str(b: &RecordBatch, name: &str) -> Vec<Option<String>> {
    let a = b.column_by_name(name).expect(name).as_string::<i32>();
    (0..a.len())
        .map(|i| a.is_valid(i).then(|| a.value(i).to_owned()))
        .collect()
}

fn writer(root: &Path, k: &ed25519_dalek_key::Key) -> Arc<AuditWriter> {
    Arc::new(AuditWriter::open(WriterConfig::new(root, 7, k.0.clone())).expect("open writer"))
}

#[test]
fn every_page_the_engine_touches_is_in_the_parquet_files() {
    let root = tmp_dir("engine");
    let k = key();
    let w = writer(&root, &k);
    let tok = tokenizer();
    let mut e = engine_with(custody_runtime::EngineConfig {
        max_batch_tokens: 24,
        ..small_cfg()
    })
    .with_audit(w.clone());
    let prompts = [
        "The capital of France is",
        "Write a haiku about rain.",
        &"Tell me a long story about a dragon. ".repeat(3),
    ];
    let mut ids = BTreeMap::new();
    for (i, p) in prompts.iter().enumerate() {
        let req = GenerateRequest {
            decoding: Default::default(),
            prompt: tok.encode(p, true).expect("enc"),
            max_tokens: 20,
            sampling: SamplingParams::default(),
            stop_ids: vec![],
            tenant: format!("tenant-{i}"),
            cache: None,
        };
        ids.insert(e.submit(req).expect("admit"), format!("tenant-{i}"));
    }
    // A fourth request is corrupted after a few steps: its failure must show as a violation row.
    let victim = e
        .submit(GenerateRequest {
            decoding: Default::default(),
            prompt: tok
                .encode("Pack my box with five dozen liquor jugs.", true)
                .expect("enc"),
            max_tokens: 20,
            sampling: SamplingParams::default(),
            stop_ids: vec![],
            tenant: "tenant-victim".into(),
            cache: None,
        })
        .expect("admit");
    let over = e.submit(GenerateRequest {
        decoding: Default::default(),
        prompt: vec![1; 5000],
        max_tokens: 1,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        tenant: "tenant-greedy".into(),
        cache: None,
    });
    assert!(over.is_err());
    let mut generated: BTreeMap<u64, usize> = BTreeMap::new();
    let mut steps = 0;
    while e.has_work() {
        steps += 1;
        if steps == 4 {
            e.fault_injection().reallocate_page(victim, 0);
        }
        for ev in e.step() {
            if let Event::Token { id, .. } = ev {
                *generated.entry(id).or_default() += 1;
            }
        }
    }
    drop(e);
    w.close().expect("seal");
    let report = digest::verify(&root, Some(&k.0.verifying_key()), None, None);
    assert!(report.ok(), "{:?}", report.problems);
    assert!(report.valid_files >= 4);

    // page_events: per request, alloc == release (same generations), writes within allocated pages.
    let mut alloc: BTreeMap<u64, BTreeSet<(u32, u32)>> = BTreeMap::new();
    let mut release: BTreeMap<u64, BTreeSet<(u32, u32)>> = BTreeMap::new();
    let mut written_slots: BTreeMap<u64, u64> = BTreeMap::new();
    let mut writes: BTreeMap<u64, BTreeSet<(u32, u32)>> = BTreeMap::new();
    for b in read_table(&root, "page_events") {
        let (req, ev, page, gen_, s0, s1) = (
            col_u64(&b, "request_id"),
            col_str(&b, "event"),
            col_u32(&b, "page"),
            col_u32(&b, "generation"),
            col_u32(&b, "slot_start"),
            col_u32(&b, "slot_end"),
        );
        for i in 0..b.num_rows() {
            let pg = (page[i].expect("page"), gen_[i].expect("generation"));
            match ev[i].as_deref() {
                Some("alloc") => {
                    assert!(alloc.entry(req[i]).or_default().insert(pg), "double alloc")
                }
                Some("release") | Some("quarantine") => {
                    assert!(release.entry(req[i]).or_default().insert(pg))
                }
                Some("write") => {
                    *written_slots.entry(req[i]).or_default() +=
                        u64::from(s1[i].expect("end") - s0[i].expect("start"));
                    writes.entry(req[i]).or_default().insert(pg);
                }
                other => panic!("unexpected page event {other:?}"),
            }
        }
    }
    // page_reads and requests.
    let mut reads: BTreeMap<u64, BTreeSet<(u32, u32)>> = BTreeMap::new();
    for b in read_table(&root, "page_reads") {
        let (req, page, gen_) = (
            col_u64(&b, "request_id"),
            col_u32(&b, "page"),
            col_u32(&b, "generation"),
        );
        for i in 0..b.num_rows() {
            reads
                .entry(req[i])
                .or_default()
                .insert((page[i].expect("p"), gen_[i].expect("g")));
        }
    }
    let mut lifecycle: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    let mut prompt_len: BTreeMap<u64, u64> = BTreeMap::new();
    for b in read_table(&root, "requests") {
        let (req, ev, pt) = (
            col_u64(&b, "request_id"),
            col_str(&b, "event"),
            col_u32(&b, "prompt_tokens"),
        );
        for i in 0..b.num_rows() {
            lifecycle
                .entry(req[i])
                .or_default()
                .push(ev[i].clone().expect("event"));
            prompt_len.insert(req[i], u64::from(pt[i].expect("pt")));
        }
    }
    for (id, tenant) in &ids {
        assert_eq!(
            lifecycle[id],
            vec!["admitted", "finished"],
            "request {id} ({tenant})"
        );
        assert_eq!(
            alloc[id], release[id],
            "every allocated page released, same generations"
        );
        assert!(writes[id].is_subset(&alloc[id]));
        assert!(reads[id].is_subset(&alloc[id]));
        assert!(!reads[id].is_empty());
        // Slots written = prompt + every generated token fed back (all but the last).
        assert_eq!(
            written_slots[id],
            prompt_len[id] + generated[id] as u64 - 1,
            "request {id}"
        );
    }
    assert_eq!(lifecycle[&victim], vec!["admitted", "failed"]);
    assert!(
        lifecycle
            .values()
            .any(|v| v == &vec!["rejected".to_owned()]),
        "the over-length request is recorded as rejected"
    );
    let viol = read_table(&root, "integrity_violations");
    let rows: usize = viol.iter().map(RecordBatch::num_rows).sum();
    assert_eq!(rows, 1);
    assert_eq!(col_u64(&viol[0], "request_id"), vec![victim]);
    assert_eq!(
        col_str(&viol[0], "kind")[0].as_deref(),
        Some("StaleGeneration")
    );
    assert_eq!(
        col_str(&viol[0], "tenant")[0].as_deref(),
        Some("tenant-victim")
    );

    // Sequence numbers: gap-free over all tables.
    let mut seqs: Vec<u64> = [
        "requests",
        "page_events",
        "page_reads",
        "integrity_violations",
    ]
    .iter()
    .flat_map(|t| read_table(&root, t))
    .flat_map(|b| col_u64(&b, "seq"))
    .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());

    // An independent reader (pyarrow + duckdb, nobody here wrote them) agrees.
    let py = format!(
        r#"
import pyarrow.dataset as ds, pyarrow.parquet as pq, duckdb, sys
root = {root:?}
n = {{}}
for t in ["requests", "page_events", "page_reads", "integrity_violations"]:
    d = ds.dataset(root + "/" + t, format="parquet", partitioning="hive")
    tb = d.to_table()
    assert "node" in tb.schema.names and "date" in tb.schema.names, tb.schema.names
    assert set(tb.column("node").to_pylist()) == {{7}}
    md = pq.ParquetFile(d.files[0]).metadata.metadata
    assert md[b"custody.audit.schema_version"] == b"7", md
    n[t] = tb.num_rows
v = duckdb.sql("select kind, tenant from read_parquet('" + root + "/integrity_violations/*/*/*.parquet', hive_partitioning=true)").fetchall()
assert v == [("StaleGeneration", "tenant-victim")], v
print(n["requests"], n["page_events"], n["page_reads"], n["integrity_violations"])
"#,
        root = root.display().to_string()
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(&py)
        .output()
        .expect("python3 (scripts/setup.sh installs pyarrow and duckdb)");
    assert!(
        out.status.success(),
        "independent reader failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let counts: Vec<usize> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(|x| x.parse().expect("n"))
        .collect();
    let ours: Vec<usize> = [
        "requests",
        "page_events",
        "page_reads",
        "integrity_violations",
    ]
    .iter()
    .map(|t| read_table(&root, t).iter().map(RecordBatch::num_rows).sum())
    .collect();
    assert_eq!(counts, ours);
    let _ = std::fs::remove_dir_all(&root);
}

/// A log with several sealed segments (several digests).
pub(crate) fn build_log(root: &Path, k: &ed25519_dalek_key::Key) {
    let w = AuditWriter::open(WriterConfig::new(root, 3, k.0.clone())).expect("writer");
    for seg in 0..3u64 {
        for i in 0..200u64 {
            let ev = AEvent::Page {
                ts_ns: custody_audit::mono_now_ns(),
                request: seg * 1000 + i,
                tenant: format!("t{}", i % 3).into(),
                page: (i % 50) as u32,
                generation: seg as u32,
                kind: PageKind::Alloc,
            };
            w.record(ev).expect("record");
            let ev = AEvent::Request {
                ts_ns: custody_audit::mono_now_ns(),
                request: seg * 1000 + i,
                tenant: format!("t{}", i % 3).into(),
                kind: custody_audit::RequestKind::Admitted,
                prompt_tokens: 3,
                output_tokens: 0,
            };
            w.record(ev).expect("record");
        }
        w.rotate().expect("rotate");
    }
    w.close().expect("close");
}

pub(crate) fn copy_dir(src: &Path, dst: &Path) {
    let _ = std::fs::remove_dir_all(dst);
    let st = Command::new("cp")
        .arg("-a")
        .arg(src)
        .arg(dst)
        .status()
        .expect("cp");
    assert!(st.success());
}

pub(crate) fn parquet_files(root: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                v.push(p);
            }
        }
    }
    v.sort();
    v
}

#[test]
fn verify_reports_every_kind_of_tampering() {
    let base = tmp_dir("tamper-base");
    let k = key();
    build_log(&base, &k);
    let vk = k.0.verifying_key();
    let clean = digest::verify(&base, Some(&vk), None, None);
    assert!(clean.ok(), "{:?}", clean.problems);
    assert_eq!((clean.valid_digests, clean.valid_files), (3, 6));

    let case = |name: &str, tamper: &dyn Fn(&Path), check: &dyn Fn(&[Problem]) -> bool| {
        let d = tmp_dir(&format!("tamper-{name}"));
        let _ = std::fs::remove_dir_all(&d);
        copy_dir(&base, &d);
        tamper(&d);
        let r = digest::verify(&d, Some(&vk), None, None);
        assert!(!r.ok(), "{name}: tampering not detected");
        assert!(
            check(&r.problems),
            "{name}: wrong findings {:?}",
            r.problems
        );
        // The CLI's messages are specific.
        for p in &r.problems {
            assert!(!p.to_string().is_empty());
        }
        let _ = std::fs::remove_dir_all(&d);
    };
    let files = |d: &Path| parquet_files(d);
    case(
        "flip",
        &|d| {
            let f = &files(d)[1];
            let mut b = std::fs::read(f).expect("read");
            let i = b.len() / 2;
            b[i] ^= 0x01;
            std::fs::write(f, b).expect("write");
        },
        &|p| matches!(p, [Problem::FileModified { .. }]),
    );
    case(
        "delete",
        &|d| std::fs::remove_file(&files(d)[0]).expect("rm"),
        &|p| matches!(p, [Problem::FileMissing { .. }]),
    );
    case(
        "extra",
        &|d| {
            let f = &files(d)[0];
            std::fs::copy(f, f.with_file_name("9999999999999999.parquet")).expect("cp");
        },
        &|p| matches!(p, [Problem::FileExtra { .. }]),
    );
    case(
        "swap",
        &|d| {
            let fs_ = files(d);
            let (a, b) = (&fs_[0], &fs_[1]);
            let tmp = a.with_extension("swap");
            std::fs::rename(a, &tmp).expect("mv");
            std::fs::rename(b, a).expect("mv");
            std::fs::rename(&tmp, b).expect("mv");
        },
        &|p| p.len() == 2 && p.iter().all(|x| matches!(x, Problem::FileReordered { .. })),
    );
    case(
        "truncate",
        &|d| {
            let f = &files(d)[2];
            let b = std::fs::read(f).expect("read");
            std::fs::write(f, &b[..b.len() - 100]).expect("write");
        },
        &|p| matches!(p, [Problem::FileTruncated { .. }]),
    );
    case(
        "delete-digest",
        &|d| {
            std::fs::remove_file(d.join("_digests/node=3/0000000000000001.json")).expect("rm");
        },
        &|p| {
            p.iter()
                .any(|x| matches!(x, Problem::DigestMissing { digest_seq: 1, .. }))
                && p.iter().any(|x| matches!(x, Problem::FileExtra { .. }))
        },
    );
    case(
        "alter-digest",
        &|d| {
            let f = d.join("_digests/node=3/0000000000000001.json");
            let s = std::fs::read_to_string(&f).expect("read");
            std::fs::write(&f, s.replacen("\"rows\": 200", "\"rows\": 199", 1)).expect("write");
        },
        &|p| p.iter().any(|x| matches!(x, Problem::BadSignature { .. })),
    );
    case(
        "reorder-digests",
        &|d| {
            let a = d.join("_digests/node=3/0000000000000000.json");
            let b = d.join("_digests/node=3/0000000000000002.json");
            let tmp = d.join("_digests/node=3/tmp");
            std::fs::rename(&a, &tmp).expect("mv");
            std::fs::rename(&b, &a).expect("mv");
            std::fs::rename(&tmp, &b).expect("mv");
        },
        &|p| {
            p.iter().any(|x| {
                matches!(
                    x,
                    Problem::ChainBroken { .. } | Problem::DigestOutOfOrder { .. }
                )
            })
        },
    );
    // A different key is refused.
    let other = key();
    let r = digest::verify(&base, Some(&other.0.verifying_key()), None, None);
    assert!(
        r.problems
            .iter()
            .all(|x| matches!(x, Problem::BadSignature { .. }))
            && r.problems.len() == 3
    );
    let _ = std::fs::remove_dir_all(&base);
}

/// The child side of the kill -9 test: records events forever, printing each durable point.
#[test]
#[ignore = "child process of kill_9_mid_stream_loses_nothing_acknowledged; run by that test"]
fn audit_writer_child_process() {
    let dir =
        PathBuf::from(std::env::var("CUSTODY_AUDIT_CHILD_DIR").expect("run by the parent test"));
    let k = digest::read_signing_key(&dir.join("key")).expect("key");
    let w = AuditWriter::open(WriterConfig::new(dir.join("log"), 1, k)).expect("writer");
    let mut i = 0u64;
    loop {
        for _ in 0..500 {
            let ev = AEvent::Page {
                ts_ns: custody_audit::mono_now_ns(),
                request: i,
                tenant: "t".into(),
                page: (i % 64) as u32,
                generation: 1,
                kind: PageKind::Alloc,
            };
            w.record(ev).expect("record");
            i += 1;
        }
        let durable = w.sync().expect("sync");
        println!("durable {durable}");
    }
}

#[test]
fn kill_9_mid_stream_loses_nothing_acknowledged() {
    let dir = tmp_dir("kill9");
    let k = key();
    digest::write_key(&k.0, &dir.join("key")).expect("key");
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--exact",
            "audit::audit_writer_child_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CUSTODY_AUDIT_CHILD_DIR", &dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut acked = 0u64;
    let mut acks = 0;
    while acks < 20 {
        let line = lines.next().expect("child output").expect("line");
        if let Some(n) = line.strip_prefix("durable ") {
            acked = n.parse().expect("n");
            acks += 1;
        }
    }
    child.kill().expect("kill -9"); // SIGKILL
    child.wait().expect("reap");
    let live: Vec<_> = std::fs::read_dir(dir.join("log/_live/node=1"))
        .expect("live dir")
        .flatten()
        .collect();
    assert!(
        !live.is_empty(),
        "the child died with an unsealed live segment"
    );
    // Restart: recovery seals the live segment.
    let w = AuditWriter::open(WriterConfig::new(dir.join("log"), 1, k.0.clone())).expect("reopen");
    w.close().expect("close");
    let r = digest::verify(&dir.join("log"), Some(&k.0.verifying_key()), None, None);
    assert!(r.ok(), "{:?}", r.problems);
    assert!(r.live_segments.is_empty());
    let mut seqs: Vec<u64> = read_table(&dir.join("log"), "page_events")
        .iter()
        .flat_map(|b| col_u64(b, "seq"))
        .collect();
    seqs.sort_unstable();
    assert!(
        seqs.len() as u64 >= acked,
        "{} rows recovered, {acked} acknowledged",
        seqs.len()
    );
    assert_eq!(
        &seqs[..acked as usize],
        &(0..acked).collect::<Vec<_>>()[..],
        "every acknowledged event is present"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn disk_full_stops_admission_instead_of_losing_events() {
    let dir = tmp_dir("diskfull");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=96k", "tmpfs"])
        .arg(&mnt)
        .status()
        .expect("mount");
    assert!(
        st.success(),
        "mounting a small tmpfs needs root (CI runs as root)"
    );
    let k = key();
    let result = std::panic::catch_unwind(|| {
        let mut cfg = WriterConfig::new(&mnt, 0, k.0.clone());
        cfg.batch_rows = 64;
        cfg.queue_capacity = 256;
        let w = Arc::new(AuditWriter::open(cfg).expect("writer"));
        let tok = tokenizer();
        let mut e = engine_with(small_cfg()).with_audit(w.clone());
        let prompt = tok
            .encode(&"Fill the disk with audit records. ".repeat(20), true)
            .expect("enc");
        let mut aborted = 0;
        let mut refused = None;
        for _ in 0..200 {
            match e.submit(GenerateRequest {
                decoding: Default::default(),
                prompt: prompt.clone(),
                max_tokens: 64,
                sampling: SamplingParams::default(),
                stop_ids: vec![],
                tenant: "t".into(),
                cache: None,
            }) {
                Ok(_) => {}
                Err(err) => {
                    refused = Some(err);
                    break;
                }
            }
            while e.has_work() {
                for ev in e.step() {
                    if let Event::Aborted { .. } = ev {
                        aborted += 1;
                    }
                }
            }
        }
        let err = refused.expect("the engine must stop admitting when the audit disk is full");
        assert!(
            matches!(err, custody_runtime::AdmissionError::AuditUnavailable(_)),
            "{err}"
        );
        assert!(err.to_string().contains("audit"), "{err}");
        assert!(e.audit_error().is_some());
        let _ = aborted;
        drop(e);
        let _ = w.close();
    });
    let _ = Command::new("umount").arg(&mnt).status();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn sealed_files_are_readable_by_datafusion_as_listing_tables() {
    let root = tmp_dir("datafusion");
    let k = key();
    build_log(&root, &k);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let (total, by_node): (i64, Vec<(u32, i64)>) = rt.block_on(async {
        let ctx = custody_query::session_over(&root).await.expect("session");
        let b = ctx.sql("SELECT count(*) AS n FROM page_events").await.expect("sql").collect().await.expect("collect");
        let total = b[0].column(0).as_primitive::<arrow::datatypes::Int64Type>().value(0);
        let b = ctx
            .sql("SELECT node, count(*) AS n FROM requests WHERE date IS NOT NULL GROUP BY node ORDER BY node")
            .await
            .expect("sql")
            .collect()
            .await
            .expect("collect");
        let nodes = b[0].column(0).as_primitive::<UInt32Type>();
        let counts = b[0].column(1).as_primitive::<arrow::datatypes::Int64Type>();
        (total, (0..b[0].num_rows()).map(|i| (nodes.value(i), counts.value(i))).collect())
    });
    let ours: usize = read_table(&root, "page_events")
        .iter()
        .map(RecordBatch::num_rows)
        .sum();
    assert_eq!(total as usize, ours);
    assert_eq!(
        by_node,
        vec![(3, 600)],
        "Hive partition column `node` and every row of requests"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn allow_drop_mode_counts_every_dropped_event_in_the_log() {
    let root = tmp_dir("drops");
    let k = key();
    let mut cfg = WriterConfig::new(&root, 5, k.0.clone());
    cfg.backpressure = custody_audit::writer::Backpressure::AllowDrop;
    cfg.queue_capacity = 4;
    cfg.fsync = custody_audit::writer::FsyncPolicy::EveryBatch;
    cfg.batch_rows = 16;
    let w = AuditWriter::open(cfg).expect("writer");
    let attempts = 20_000u64;
    for i in 0..attempts {
        let ev = AEvent::Page {
            ts_ns: custody_audit::mono_now_ns(),
            request: i,
            tenant: "t".into(),
            page: 0,
            generation: 1,
            kind: PageKind::Alloc,
        };
        w.record(ev)
            .expect("allow_drop never refuses while the writer lives");
    }
    let dropped = w.dropped_total();
    w.close().expect("close");
    assert!(
        dropped > 0,
        "a 4-slot queue under a 20k-event flood must drop"
    );
    let kept: usize = read_table(&root, "page_events")
        .iter()
        .map(RecordBatch::num_rows)
        .sum();
    let logged: u64 = read_table(&root, "writer_events")
        .iter()
        .flat_map(|b| {
            let ev = col_str(b, "event");
            col_u64(b, "count")
                .into_iter()
                .zip(ev)
                .filter(|(_, e)| e.as_deref() == Some("dropped"))
                .map(|(c, _)| c)
        })
        .sum();
    assert_eq!(logged, dropped, "every drop is counted in the log itself");
    assert_eq!(
        kept as u64 + dropped,
        attempts,
        "nothing disappears uncounted"
    );
    assert!(digest::verify(&root, Some(&k.0.verifying_key()), None, None).ok());
    let _ = std::fs::remove_dir_all(&root);
}

/// The single `count(*)`-like value `sql` returns.
pub(crate) async fn count_one(
    ctx: &custody_query::datafusion::prelude::SessionContext,
    sql: &str,
) -> i64 {
    let b = ctx
        .sql(sql)
        .await
        .expect("sql")
        .collect()
        .await
        .expect("collect");
    b[0].column(0)
        .as_primitive::<arrow::datatypes::Int64Type>()
        .value(0)
}

#[test]
fn verified_session_uses_only_digest_named_files_and_marks_the_live_segment() {
    let root = tmp_dir("verified-session");
    let k = key();
    build_log(&root, &k); // 3 sealed segments, 200 page_events each
    // Tamper with one sealed page_events file and plant an unnamed one.
    let pe: Vec<PathBuf> = parquet_files(&root)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("/page_events/"))
        .collect();
    let mut b = std::fs::read(&pe[0]).expect("read");
    let mid = b.len() / 2;
    b[mid] ^= 0x40;
    std::fs::write(&pe[0], b).expect("write");
    std::fs::copy(&pe[1], pe[1].with_file_name("7777777777777777.parquet")).expect("plant");
    // An unsealed live segment with 50 more events (writer left running, never sealed).
    let w = AuditWriter::open(WriterConfig::new(&root, 3, k.0.clone())).expect("writer");
    for i in 0..50u64 {
        let ev = AEvent::Page {
            ts_ns: custody_audit::mono_now_ns(),
            request: 9000 + i,
            tenant: "late".into(),
            page: 1,
            generation: 9,
            kind: PageKind::Alloc,
        };
        w.record(ev).expect("record");
    }
    w.sync().expect("durable");
    std::mem::forget(w); // simulate a node that has not sealed yet
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let (sealed, live, problems) = rt.block_on(async {
        let vs = custody_query::session_over_verified(&root, Some(&k.0.verifying_key()))
            .await
            .expect("session");
        let count = |sql: &'static str| count_one(&vs.ctx, sql);
        (
            count("SELECT count(*) FROM page_events").await,
            count("SELECT count(*) FROM page_events_live").await,
            vs.report.problems.len(),
        )
    });
    assert_eq!(
        sealed, 400,
        "the tampered file (200 rows) and the planted file are excluded"
    );
    assert_eq!(
        live, 50,
        "the live segment is queryable, under its own name"
    );
    assert_eq!(problems, 2, "and the exclusions are reported");
    let _ = std::fs::remove_dir_all(&root);
}

/// A witnessed write outside its transfer's page, where the target recorded no landing, is a
/// `misdirected_write` whose row says so — every field filled (CONCAT skips NULLs, so the
/// missing landing once printed as "page  gen  of request  ()").
#[test]
fn a_misdirected_write_that_landed_nowhere_recorded_says_so() {
    let root = tmp_dir("crosscheck-misdirected");
    let k = key();
    let w = AuditWriter::open(WriterConfig::new(&root, 1, k.0.clone())).expect("writer");
    w.record(AEvent::Transfer {
        ts_ns: custody_audit::mono_now_ns(),
        transfer: 5,
        request: 42,
        tenant: "acme".into(),
        src_node: 1,
        src_page: 3,
        src_generation: 1,
        dst_node: 2,
        dst_page: 8,
        dst_generation: 4,
        bytes: 4096,
        checksum: 7,
        outcome: "ok".into(),
        rkey: 11,
        remote_addr: 1 << 20,
        remote_len: 4096,
        wire_bytes: 4096,
        work_requests: 1,
    })
    .expect("transfer");
    w.record(AEvent::RdmaOp(Box::new(custody_audit::RdmaOp {
        ts_ns: custody_audit::mono_now_ns(),
        ktime_ns: 1,
        pid: 1,
        tid: 1,
        op: "post_write",
        ctx: 1 << 32,
        wr_id: 5,
        chain_index: 0,
        opcode: 0,
        flags: 0,
        imm: 0,
        remote_addr: 9 << 20,
        rkey: 11,
        num_sge: 1,
        bytes: 4096,
        status: 0,
        qp_num: 0,
        sges: None,
        probe_flags: None,
    })))
    .expect("observed write");
    w.close().expect("seal");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let cc = rt.block_on(async {
        let vs = custody_query::session_over_verified(&root, Some(&k.0.verifying_key()))
            .await
            .expect("session");
        custody_query::prepare_forensics(&vs.ctx)
            .await
            .expect("prepare");
        custody_query::forensics::crosscheck(&vs.ctx)
            .await
            .expect("crosscheck")
    });
    // The write is also outside its transfer's span (`transfer_mismatch`, the engine's side).
    let d = cc
        .discrepancies
        .iter()
        .find(|d| d.kind == "misdirected_write")
        .unwrap_or_else(|| panic!("{cc:?}"));
    assert_eq!(
        (d.kind.as_str(), d.wr_id),
        ("misdirected_write", 5),
        "{d:?}"
    );
    assert!(
        d.engine.contains("request 42 (acme) page 8 gen 4, key 11"),
        "{d:?}"
    );
    assert!(
        d.witness.ends_with("landed in no page the target recorded"),
        "{d:?}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

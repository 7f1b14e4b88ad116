//! An audit root in an object store: a real log, uploaded into a local S3-compatible server
//! (moto, from PyPI; `scripts/setup.sh` installs it), verified and queried through the store.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{AsArray, RecordBatch, StringArray};
use custody_audit::digest::{self, Problem};
use custody_audit::writer::{AuditWriter, WriterConfig};
use custody_audit::{AuditSink, Event, PageKind, RequestKind, Writer};
use custody_query::datafusion::arrow::util::pretty::pretty_format_batches;
use custody_query::datafusion::object_store::aws::AmazonS3Builder;
use custody_query::datafusion::object_store::path::Path as ObjectPath;
use custody_query::datafusion::object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use custody_query::{AuditRoot, VerifiedSession, forensics, source};

use crate::audit::{copy_dir, count_one, tmp_dir};

pub(crate) const BUCKET: &str = "custody-audit";
const PREFIX: &str = "fleet/prod";

/// A moto S3 server on 127.0.0.1, killed (and reaped) when dropped, also when a test panics.
pub(crate) struct Moto {
    child: Child,
    pub(crate) endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The S3 client needs the I/O and timer drivers; two workers, as on the CLI's 2-core machines.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

impl Moto {
    pub(crate) fn start() -> Self {
        let ok = Command::new("python3")
            .args(["-c", "import moto.server, boto3"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "python3 with moto[server] is needed (a local S3-compatible server): run scripts/setup.sh"
        );
        let port = free_port();
        let child = Command::new("python3")
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn python3 -m moto.server (run scripts/setup.sh)");
        let mut m = Moto {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        // Up within 30 s (it takes a second or two), or the test says why not.
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(st)) = m.child.try_wait() {
                let mut err = String::new();
                if let Some(e) = m.child.stderr.take() {
                    for l in BufReader::new(e).lines().map_while(Result::ok).take(40) {
                        err.push_str(&l);
                        err.push('\n');
                    }
                }
                panic!("moto server exited ({st}); run scripts/setup.sh\n{err}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "moto server not listening after 30 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // Its log is not needed; a full pipe must not block it.
        drop(m.child.stderr.take());
        m.create_bucket(BUCKET);
        m
    }

    pub(crate) fn create_bucket(&self, bucket: &str) {
        let py = format!(
            "import boto3; boto3.client('s3', endpoint_url='{}', aws_access_key_id='test', \
             aws_secret_access_key='test', region_name='us-east-1').create_bucket(Bucket='{bucket}')",
            self.endpoint
        );
        let out = Command::new("python3")
            .args(["-c", &py])
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "create bucket: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The `AWS_*` variables a `custody` process reads this server's buckets with.
    pub(crate) fn env(&self) -> [(&'static str, String); 5] {
        [
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// A client configured explicitly (the CLI's comes from the `AWS_*` environment; see
    /// [`s3_session_from_the_environment_child`]).
    pub(crate) fn client(&self) -> Arc<dyn ObjectStore> {
        self.client_for(BUCKET)
    }

    pub(crate) fn client_for(&self, bucket: &str) -> Arc<dyn ObjectStore> {
        source::s3_store_with(
            AmazonS3Builder::new()
                .with_endpoint(&self.endpoint)
                .with_allow_http(true)
                .with_access_key_id("test")
                .with_secret_access_key("test")
                .with_region("us-east-1"),
            bucket,
        )
        .expect("s3 client")
    }
}

/// Requests of two tenants on one node: admission, a page allocated and written, reads of it,
/// completion, release (6 events a request); `rotate` seals a segment every 25 requests.
fn record(w: &AuditWriter, node: u32, requests: std::ops::Range<u64>, rotate: bool) {
    for r in requests {
        let tenant: Arc<str> = if r % 2 == 0 { "acme" } else { "globex" }.into();
        let (page, generation) = ((r % 8) as u32 + node * 100, (r / 8) as u32);
        let ts = custody_audit::mono_now_ns;
        let request = |kind| Event::Request {
            ts_ns: ts(),
            request: r,
            tenant: tenant.clone(),
            kind,
            prompt_tokens: 16,
            output_tokens: 4,
        };
        let page_ev = |kind| Event::Page {
            ts_ns: ts(),
            request: r,
            tenant: tenant.clone(),
            page,
            generation,
            kind,
        };
        let events = [
            request(RequestKind::Admitted),
            page_ev(PageKind::Alloc),
            page_ev(PageKind::Write {
                slot_start: 0,
                slot_end: 16,
                writer: Writer::Local,
            }),
            Event::Read {
                ts_ns: ts(),
                request: r,
                tenant: tenant.clone(),
                page,
                generation,
                slot_start: 0,
                slot_end: 16,
                first_step: 0,
                last_step: 3,
                verified: true,
            },
            request(RequestKind::Finished {
                reason: "stop".into(),
            }),
            page_ev(PageKind::Release),
        ];
        for ev in events {
            w.record(ev).expect("record");
        }
        if rotate && r % 25 == 24 {
            w.rotate().expect("rotate");
        }
    }
}

/// Two nodes, four sealed segments, and node 2's unsealed live segment: the root as a node that
/// is still writing leaves it (copied after a durable sync, before the writer seals it).
fn build_root(dir: &Path, key: &ed25519_dalek::SigningKey) -> std::path::PathBuf {
    let live = dir.join("writing");
    let w1 = AuditWriter::open(WriterConfig::new(&live, 1, key.clone())).expect("writer 1");
    record(&w1, 1, 0..50, true);
    w1.close().expect("close 1");
    let w2 = AuditWriter::open(WriterConfig::new(&live, 2, key.clone())).expect("writer 2");
    record(&w2, 2, 0..50, true);
    record(&w2, 2, 50..60, false);
    w2.sync().expect("durable");
    let snapshot = dir.join("root");
    copy_dir(&live, &snapshot);
    w2.close().expect("close 2");
    snapshot
}

/// Every file under `local` into the bucket under `prefix`, through the object store client.
pub(crate) async fn upload(client: &dyn ObjectStore, local: &Path, prefix: &str) -> usize {
    let mut n = 0;
    let mut stack = vec![local.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let rel = p
                .strip_prefix(local)
                .expect("under root")
                .to_str()
                .expect("utf-8");
            put(client, prefix, rel, std::fs::read(&p).expect("read")).await;
            n += 1;
        }
    }
    n
}

/// The answers compared between the local and the S3 session: row counts, per-tenant and
/// per-node breakdowns, every read, the live segment, and one canned forensic question.
const QUERIES: &[&str] = &[
    "SELECT count(*) AS n FROM page_events",
    "SELECT tenant, event, count(*) AS n FROM page_events GROUP BY tenant, event ORDER BY tenant, event",
    "SELECT node_id, event, count(*) AS n FROM requests GROUP BY node_id, event ORDER BY node_id, event",
    "SELECT node_id, seq, request_id, tenant, page, generation, slot_start, slot_end FROM page_reads ORDER BY node_id, seq",
    "SELECT count(*) AS n, min(seq) AS lo, max(seq) AS hi FROM page_events_live",
];

async fn answers(vs: &VerifiedSession) -> Vec<String> {
    custody_query::prepare_forensics(&vs.ctx)
        .await
        .expect("forensic views");
    let mut out = Vec::new();
    let tenant = forensics::tenant_sql("acme", None, None);
    for sql in QUERIES.iter().copied().chain([tenant.as_str()]) {
        let b = custody_query::run_script(&vs.ctx, sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .pop()
            .unwrap_or_else(|| panic!("{sql}: no result"));
        out.push(pretty_format_batches(&b).expect("format").to_string());
    }
    out
}

async fn count(vs: &VerifiedSession, sql: &str) -> i64 {
    count_one(&vs.ctx, sql).await
}

/// Write `bytes` to `<prefix>/<rel>` in the bucket.
async fn put(client: &dyn ObjectStore, prefix: &str, rel: &str, bytes: Vec<u8>) {
    client
        .put(
            &ObjectPath::parse(format!("{prefix}/{rel}")).expect("object path"),
            PutPayload::from(bytes),
        )
        .await
        .unwrap_or_else(|e| panic!("put {prefix}/{rel}: {e}"));
}

/// The sealed page_events file of node 1 with one row's tenant changed: valid Parquet, so a
/// reader that skips verification takes it at face value.
fn forge(file: &Path) -> (Vec<u8>, usize) {
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
        std::fs::File::open(file).expect("open"),
    )
    .expect("parquet")
    .build()
    .expect("reader");
    let batches: Vec<RecordBatch> = reader.map(|b| b.expect("batch")).collect();
    let rows = batches.iter().map(RecordBatch::num_rows).sum();
    let schema = batches[0].schema();
    let mut out = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut out, schema.clone(), None).expect("w");
    for (i, b) in batches.iter().enumerate() {
        let mut cols = b.columns().to_vec();
        if i == 0 {
            let t = schema.index_of("tenant").expect("tenant column");
            let mut v: Vec<Option<String>> = b
                .column(t)
                .as_string::<i32>()
                .iter()
                .map(|s| s.map(str::to_owned))
                .collect();
            v[0] = Some("mallory".to_owned());
            cols[t] = Arc::new(StringArray::from(v));
        }
        w.write(&RecordBatch::try_new(schema.clone(), cols).expect("batch"))
            .expect("write");
    }
    w.close().expect("close");
    (out, rows)
}

#[test]
fn audit_root_in_s3_is_verified_and_queried_through_the_store() {
    let dir = tmp_dir("s3");
    let key = digest::generate_key().expect("key");
    let vk = key.verifying_key();
    let moto = Moto::start(); // first: a machine without moto fails with what to run
    let root = build_root(&dir, &key);
    let client = moto.client();
    let url = format!("s3://{BUCKET}/{PREFIX}");
    let s3_root = AuditRoot::parse(&url).expect("url");
    let rt = runtime();
    rt.block_on(async {
        let uploaded = upload(client.as_ref(), &root, PREFIX).await;
        assert!(uploaded >= 10, "{uploaded} objects");

        let local = custody_query::session_over_verified(&root, Some(&vk))
            .await
            .expect("local session");
        let remote =
            custody_query::open_session_with(&s3_root, Some(client.clone()), Some(&vk), false)
                .await
                .expect("s3 session");
        let (l, r) = (&local.report, &remote.report);
        assert!(l.ok() && r.ok(), "{:?} / {:?}", l.problems, r.problems);
        assert_eq!(
            (r.valid_digests, r.valid_files, r.live_segments.len()),
            (l.valid_digests, l.valid_files, l.live_segments.len())
        );
        assert_eq!(r.valid_digests, 4, "two nodes, two sealed segments each");
        assert!(!r.live_segments.is_empty(), "node 2's live segment");
        assert!(
            r.verified_files
                .iter()
                .all(|f| f.to_string_lossy().starts_with(&format!("{url}/"))),
            "objects are named by their URLs: {:?}",
            r.verified_files
        );
        let expected = answers(&local).await;
        assert_eq!(answers(&remote).await, expected);
        // 100 sealed requests, 3 page events each (alloc, write, release).
        assert!(expected[0].contains("| 300 |"), "{}", expected[0]);
        let total = count(&remote, "SELECT count(*) FROM page_events").await;

        // Forge one sealed object in place: it is reported and left out.
        let victim = root
            .join("page_events/node=1")
            .read_dir()
            .expect("date dir")
            .flatten()
            .next()
            .expect("a date partition")
            .path();
        let victim = victim
            .read_dir()
            .expect("files")
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "parquet"))
            .expect("a sealed file");
        let (forged, rows) = forge(&victim);
        let rel = victim.strip_prefix(&root).expect("rel").to_str().expect("utf-8");
        put(client.as_ref(), PREFIX, rel, forged).await;
        let tampered =
            custody_query::open_session_with(&s3_root, Some(client.clone()), Some(&vk), false)
                .await
                .expect("s3 session");
        let object = format!("{url}/{rel}");
        assert!(
            matches!(&tampered.report.problems[..], [Problem::FileModified { path }] if path.to_str() == Some(object.as_str())),
            "{:?}",
            tampered.report.problems
        );
        assert_eq!(
            count(&tampered, "SELECT count(*) FROM page_events").await,
            total - rows as i64,
            "the forged object is excluded"
        );
        assert_eq!(
            count(&tampered, "SELECT count(*) FROM page_events WHERE tenant = 'mallory'").await,
            0
        );
        // Asked for, the unverified object is read (and the forged row shows).
        let all = custody_query::open_session_with(&s3_root, Some(client.clone()), Some(&vk), true)
            .await
            .expect("s3 session, unverified included");
        assert!(all.unverified_included && !all.report.ok());
        assert_eq!(count(&all, "SELECT count(*) FROM page_events").await, total);
        assert_eq!(
            count(&all, "SELECT count(*) FROM page_events WHERE tenant = 'mallory'").await,
            1
        );
    });

    // The CLI's path: the client from the AWS_* environment, in a child process (the test
    // process's environment is shared by every test thread).
    let child = |endpoint: &str| {
        let t0 = Instant::now();
        let out = Command::new(std::env::current_exe().expect("exe"))
            .args([
                "--exact",
                "s3::s3_session_from_the_environment_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env_clear()
            .env("CUSTODY_S3_CHILD_ROOT", &url)
            .env("AWS_ENDPOINT_URL", endpoint)
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ALLOW_HTTP", "true")
            .output()
            .expect("spawn child");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = stdout
            .lines()
            // The harness may print the test's name on the same line first.
            .find_map(|l| l.split_once("child-result: ").map(|(_, r)| r))
            .map(str::to_owned)
            .unwrap_or_else(|| {
                panic!(
                    "child printed no result:\n{stdout}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        (line, t0.elapsed())
    };
    let (line, _) = child(&moto.endpoint);
    assert!(
        line.starts_with("verified ") && line.contains("problems 1"),
        "{line}"
    );
    // A dead endpoint: a clear error within seconds, not minutes of retries.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let (line, took) = child(&dead);
    assert!(line.starts_with("error: "), "{line}");
    assert!(took < Duration::from_secs(20), "took {took:?}: {line}");
    drop(moto);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The child side of the test above: opens `CUSTODY_S3_CHILD_ROOT` with the S3 client configured
/// from the environment, as `custody query` does, and prints one line.
#[test]
#[ignore = "child process of audit_root_in_s3_is_verified_and_queried_through_the_store"]
fn s3_session_from_the_environment_child() {
    let url = std::env::var("CUSTODY_S3_CHILD_ROOT").expect("run by the parent test");
    let root = AuditRoot::parse(&url).expect("url");
    let rt = runtime();
    let line = rt.block_on(async {
        match custody_query::open_session(&root, None, false).await {
            Ok(vs) => format!(
                "verified {} problems {} rows {}",
                vs.report.valid_files,
                vs.report.problems.len(),
                count(&vs, "SELECT count(*) FROM page_events").await
            ),
            Err(e) => format!("error: {e}"),
        }
    });
    println!("child-result: {line}");
}

/// Checkpoints published into an object-store prefix (the moto server) catch a cut tail after
/// the attacker with the node's disk also deleted the root's own copy.
#[test]
fn a_cut_tail_is_found_from_checkpoints_in_an_object_store() {
    use custody_audit::digest::{Expect, LocalStore};
    use custody_query::checkpoints::{ObjectCheckpointSink, fetch_checkpoints_with};

    let moto = Moto::start();
    let dir = tmp_dir("s3-checkpoints");
    let key = digest::generate_key().expect("key");
    let url = format!("s3://{BUCKET}/checkpoints/prod");
    let sink = ObjectCheckpointSink::new(moto.client(), &url).expect("sink");
    crate::checkpoint::node_log(&dir, &key, vec![Arc::new(sink)]);
    crate::checkpoint::cut_tail(&dir, true);
    let checkpoints = fetch_checkpoints_with(moto.client(), &url).expect("fetch");
    assert_eq!(checkpoints.len(), 1, "one object per node: {checkpoints:?}");
    assert!(checkpoints[0].1.starts_with(&url), "{}", checkpoints[0].1);
    let blind = digest::verify(&dir, Some(&key.verifying_key()), None, None);
    assert!(
        blind.ok(),
        "without the outside checkpoint: {:?}",
        blind.problems
    );
    let r = digest::verify_reporting(
        &LocalStore::new(&dir),
        Some(&key.verifying_key()),
        None,
        None,
        &Expect {
            checkpoints,
            ..Expect::default()
        },
    );
    assert!(
        crate::checkpoint::tail_cut(&r).is_some_and(|p| p.starts_with("s3://")),
        "{:?}",
        r.problems
    );
    drop(moto);
    let _ = std::fs::remove_dir_all(&dir);
}

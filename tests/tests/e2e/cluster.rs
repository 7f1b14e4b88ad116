//! Forensics on an Apache DataFusion Ballista cluster: `custody cluster scheduler` and two
//! `custody cluster executor`s as separate processes on loopback, each on its own ports, and
//! `custody forensics … --cluster df://…` against them — the same answers as the local tool on the
//! incident's log and a synthetic one (and the synthetic log's injected truth), from a directory
//! and from S3 (moto); a planted and a tampered file never reach the cluster; an executor killed
//! mid-query gives a correct answer or a clear error, never a wrong answer.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use custody_query::datafusion::object_store::ObjectStore;
use futures::TryStreamExt;

use crate::audit::{copy_dir, tmp_dir};
use crate::s3::{BUCKET, Moto, runtime, upload};
use crate::symbols::default_features_binary;

/// A `custody` process, killed (and reaped) when dropped, also when the test panics.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `N` distinct free ports: every listener is held until all are chosen.
fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    std::array::from_fn(|i| held[i].local_addr().expect("addr").port())
}

/// `env` applied to a `custody` command (the S3 server's variables, or none).
type Env<'a> = &'a [(&'static str, String)];

fn spawn(args: &[&str], log: &Path, env: Env<'_>) -> Proc {
    let out = std::fs::File::create(log).expect("log file");
    let err = out.try_clone().expect("log file");
    let child = Command::new(default_features_binary())
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        // The scheduler logs each job's plan (with its files) at info: the test reads it.
        .env("RUST_LOG", "info")
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn custody (scripts/test.sh builds it)");
    Proc(child)
}

/// Whether `GET path` on 127.0.0.1:`port` answers 200.
fn http_ok(port: u16, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    let mut resp = String::new();
    s.write_all(req.as_bytes()).is_ok()
        && s.read_to_string(&mut resp).is_ok()
        && resp.starts_with("HTTP/1.1 200")
}

/// One scheduler and two executors, each with its own ports.
struct Cluster {
    url: String,
    scheduler_log: PathBuf,
    executors: Vec<Option<Proc>>,
    // Last: killed after the executors.
    _scheduler: Proc,
}

impl Cluster {
    fn start(dir: &Path, env: Env<'_>) -> Self {
        let [port, f0, g0, h0, f1, g1, h1] = free_ports::<7>();
        let scheduler_log = dir.join("scheduler.log");
        let scheduler = spawn(
            &[
                "cluster",
                "scheduler",
                "--port",
                &port.to_string(),
                "--executor-timeout-s",
                "6",
            ],
            &scheduler_log,
            env,
        );
        let url = format!("df://127.0.0.1:{port}");
        let mut executors = Vec::new();
        let mut health = Vec::new();
        for (i, [flight, grpc, h]) in [[f0, g0, h0], [f1, g1, h1]].into_iter().enumerate() {
            let work = dir.join(format!("executor-{i}"));
            std::fs::create_dir_all(&work).expect("work dir");
            executors.push(Some(spawn(
                &[
                    "cluster",
                    "executor",
                    "--scheduler",
                    &url,
                    "--port",
                    &flight.to_string(),
                    "--grpc-port",
                    &grpc.to_string(),
                    "--health-port",
                    &h.to_string(),
                    "--vcores",
                    "1",
                    "--heartbeat-s",
                    "1",
                    "--work-dir",
                    work.to_str().expect("utf-8"),
                ],
                &dir.join(format!("executor-{i}.log")),
                env,
            )));
            health.push(h);
        }
        // Ready: each executor registered with the scheduler (its /readyz), within 60 s.
        let t0 = Instant::now();
        while !health.iter().all(|&h| http_ok(h, "/readyz")) {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "executors not ready after 60 s; see {}",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        Cluster {
            url,
            scheduler_log,
            executors,
            _scheduler: scheduler,
        }
    }

    fn scheduler_log(&self) -> String {
        std::fs::read_to_string(&self.scheduler_log).expect("scheduler log")
    }
}

/// `custody forensics <question> ROOT --format csv [--cluster … --scratch …]`.
fn forensics(
    question: &[&str],
    root: &str,
    key: &Path,
    on: Option<(&Cluster, &str)>,
    env: Env<'_>,
) -> Command {
    let mut c = Command::new(default_features_binary());
    c.arg("forensics")
        .arg(question[0])
        .arg(root)
        .args(&question[1..])
        .args(["--format", "csv", "--public-key"])
        .arg(key)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("RUST_LOG", "warn");
    if let Some((cluster, scratch)) = on {
        c.args(["--cluster", &cluster.url, "--scratch", scratch]);
    }
    c
}

/// What the scheduler logs for each job it accepts.
const SUBMITTED: &str = "Submitting execution graph";

/// How long one `custody` command may take here (debug build, 2 cores): a query that hangs on
/// the cluster fails the test instead of stalling the suite.
const COMMAND_LIMIT: Duration = Duration::from_secs(300);

/// `c`'s output, killed (and the test failed) past [`COMMAND_LIMIT`]. Its pipes are drained
/// while it runs (a full pipe would stall it).
fn output_within_limit(c: &mut Command, what: &str) -> Output {
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run custody");
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if t0.elapsed() > COMMAND_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            let err = err.join().expect("stderr");
            panic!(
                "{what}: no answer within {} s\n{}",
                COMMAND_LIMIT.as_secs(),
                String::from_utf8_lossy(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: out.join().expect("stdout"),
        stderr: err.join().expect("stderr"),
    }
}

fn run(mut c: Command, what: &str) -> Output {
    let o = output_within_limit(&mut c, what);
    assert!(
        o.status.success(),
        "{what}: {:?}\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// `forensics exposure` on `local_root` in this process's tool and on `remote_root` through the
/// cluster: the same standard output, byte for byte. Returns the cluster's run.
fn same_as_local(
    local_root: &str,
    remote_root: &str,
    key: &Path,
    on: (&Cluster, &str),
    env: Env<'_>,
) -> Output {
    let local = run(
        forensics(&["exposure"], local_root, key, None, &[]),
        "local",
    );
    let remote = run(
        forensics(&["exposure"], remote_root, key, Some(on), env),
        "cluster",
    );
    assert_eq!(text(&remote.stdout), text(&local.stdout), "{remote_root}");
    remote
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Affected responses from `forensics exposure --format csv`: (node, request) → (recipient,
/// sorted (source tenant, foreign slots)).
type Answer = std::collections::BTreeMap<(u64, u64), (String, Vec<(String, u64)>)>;

fn exposure_rows(stdout: &str) -> Answer {
    let mut got = Answer::new();
    for line in stdout.lines() {
        let p: Vec<&str> = line.split(',').collect();
        let (Some(node), Some(req)) = (
            p.first().and_then(|s| s.parse().ok()),
            p.get(1).and_then(|s| s.parse().ok()),
        ) else {
            continue;
        };
        if p.len() != 8 {
            continue;
        }
        let e = got
            .entry((node, req))
            .or_insert_with(|| (p[2].to_owned(), vec![]));
        e.1.push((p[3].to_owned(), p[4].parse().expect("slots")));
    }
    for v in got.values_mut() {
        v.1.sort();
    }
    got
}

/// The synthetic log's injected truth in the same shape.
fn truth(root: &Path) -> Answer {
    let t: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root.join("synth-truth.json")).expect("synth-truth.json"),
    )
    .expect("json");
    let mut want = Answer::new();
    for e in t["exposures"].as_array().expect("exposures") {
        let mut sources: Vec<(String, u64)> = e["sources"]
            .as_array()
            .expect("sources")
            .iter()
            .map(|s| {
                (
                    s[0].as_str().expect("tenant").to_owned(),
                    s[1].as_u64().expect("slots"),
                )
            })
            .collect();
        sources.sort();
        want.insert(
            (
                e["node"].as_u64().expect("node"),
                e["request"].as_u64().expect("request"),
            ),
            (
                e["recipient_tenant"]
                    .as_str()
                    .expect("recipient")
                    .to_owned(),
                sources,
            ),
        );
    }
    want
}

/// The first sealed file of `table` on `node` (relative to the root).
fn sealed_file(root: &Path, table: &str, node: u32) -> PathBuf {
    let dir = root.join(table).join(format!("node={node}"));
    let mut stack = vec![dir];
    while let Some(d) = stack.pop() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&d)
            .expect("read_dir")
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                return p.strip_prefix(root).expect("under root").to_path_buf();
            }
        }
    }
    panic!("no sealed {table} file for node {node}")
}

#[test]
fn a_ballista_cluster_answers_as_the_local_tool_and_never_reads_an_unverified_file() {
    let dir = tmp_dir("cluster");
    let scratch = dir.join("scratch");
    let scratch = scratch.to_str().expect("utf-8");
    // The S3 server first: the executors read the bucket with its variables.
    let moto = Moto::start();
    moto.create_bucket("custody-scratch");
    let env = moto.env();
    let mut cluster = Cluster::start(&dir, &env);

    // A synthetic log with injected exposures, faults and prefix-cache hits: the cluster's
    // answer is the local tool's, byte for byte, and the injected truth.
    let synth = dir.join("synth");
    let s = synth.to_str().expect("utf-8");
    run(
        {
            let mut c = Command::new(default_features_binary());
            c.args(["audit", "synth", "--out", s, "--events", "150000"])
                .args(["--fault-rate", "0.02", "--cache-hit-rate", "0.3"]);
            c
        },
        "synth",
    );
    let key = synth.join("synth-key.pub");
    let on = Some((&cluster, scratch));
    let remote = same_as_local(s, s, &key, (&cluster, scratch), &[]);
    let synth_answer = text(&remote.stdout);
    let answer = exposure_rows(&text(&remote.stdout));
    assert!(!answer.is_empty());
    assert_eq!(
        answer,
        truth(&synth),
        "the cluster's answer is the injected truth"
    );
    assert!(
        text(&remote.stderr).contains("handed to the cluster by name"),
        "{}",
        text(&remote.stderr)
    );
    // Another question with unions, joins and a global sort: the same rows (its ORDER BY leaves
    // ties, whose order neither engine fixes).
    let sorted = |o: &Output| {
        let mut l: Vec<String> = text(&o.stdout).lines().map(str::to_owned).collect();
        l.sort();
        l
    };
    let local = run(forensics(&["anomalies"], s, &key, None, &[]), "anomalies");
    let remote = run(forensics(&["anomalies"], s, &key, on, &[]), "anomalies");
    assert!(sorted(&local).len() > 10);
    assert_eq!(sorted(&remote), sorted(&local));
    // The scratch directory is gone after each command.
    assert_eq!(
        std::fs::read_dir(scratch).map_or(0, |d| d.count()),
        0,
        "scratch left behind"
    );

    // The incident's log (a real pair with the unsafe switches on): one affected response.
    let incident = dir.join("incident");
    let ikey = crate::disagg::incident_audit_root(&incident);
    let ikey_path = dir.join("incident.pub");
    std::fs::write(
        &ikey_path,
        custody_audit::digest::hex(ikey.verifying_key().as_bytes()),
    )
    .expect("key");
    let i = incident.to_str().expect("utf-8");
    let remote = same_as_local(i, i, &ikey_path, (&cluster, scratch), &[]);
    let answer = exposure_rows(&text(&remote.stdout));
    assert_eq!(answer.len(), 1, "{answer:?}");
    let (recipient, sources) = answer.values().next().expect("one");
    assert_eq!(recipient, "tenant-b");
    assert_eq!(sources.len(), 1);
    assert_eq!(sources[0].0, "tenant-a");
    assert!(sources[0].1 > 100, "{sources:?}");

    // A planted file and a tampered one: excluded by verification, here, before the cluster
    // plans anything — the scheduler's plans never name them.
    let damaged = dir.join("damaged");
    copy_dir(&synth, &damaged);
    let tampered = sealed_file(&damaged, "page_events", 2);
    let donor = sealed_file(&damaged, "page_events", 3);
    std::fs::copy(damaged.join(&donor), damaged.join(&tampered)).expect("tamper");
    let victim = sealed_file(&damaged, "page_reads", 1);
    let planted = victim.with_file_name("9999999999999999.parquet");
    std::fs::copy(damaged.join(&victim), damaged.join(&planted)).expect("plant");
    let d = damaged.to_str().expect("utf-8");
    let before = cluster.scheduler_log().len();
    let remote = same_as_local(d, d, &key, (&cluster, scratch), &[]);
    // Reading the unverified files would change the answer (a test that can fail).
    let mut all = forensics(&["exposure"], d, &key, None, &[]);
    all.arg("--include-unverified");
    let all = run(all, "local, unverified included");
    assert_ne!(
        exposure_rows(&text(&all.stdout)),
        exposure_rows(&text(&remote.stdout)),
        "the planted and tampered files must matter to the answer"
    );
    let err = text(&remote.stderr);
    assert!(
        err.contains("verification problems") && err.contains("EXCLUDED"),
        "{err}"
    );
    let plans = cluster.scheduler_log()[before..].to_owned();
    let name = |p: &Path| format!("damaged/{}", p.display());
    assert!(
        plans.contains(&name(&donor)),
        "the scheduler logs the files it plans"
    );
    for unverified in [&tampered, &planted] {
        assert!(
            !plans.contains(&name(unverified)),
            "{} reached the cluster",
            unverified.display()
        );
    }

    // The same log in S3 (moto), the scratch in another bucket: the executors read and write
    // both through the store; the answer is the same; the scratch prefix is emptied.
    let rt = runtime();
    rt.block_on(upload(moto.client().as_ref(), &synth, "synth"));
    let s3_root = format!("s3://{BUCKET}/synth");
    same_as_local(
        s,
        &s3_root,
        &key,
        (&cluster, "s3://custody-scratch/tmp"),
        &env,
    );
    let left: Vec<_> = rt
        .block_on(
            moto.client_for("custody-scratch")
                .list(None)
                .try_collect::<Vec<_>>(),
        )
        .expect("list scratch");
    assert!(left.is_empty(), "scratch left in S3: {left:?}");

    // An executor killed (SIGKILL) while a job of the exposure query runs: the query completes
    // correctly on the survivor or fails with a clear error — Ballista 55 leaves the job
    // waiting (see docs/forensics.md), and the client's --cluster-timeout-s ends it — never a
    // wrong answer.
    let mut query = forensics(&["exposure"], s, &key, on, &[]);
    query.args(["--cluster-timeout-s", "60"]);
    let jobs_before = cluster.scheduler_log().matches(SUBMITTED).count();
    let killer = std::thread::spawn(move || {
        // Once the query's first job is on the cluster (verification done), and running.
        let t0 = Instant::now();
        while cluster.scheduler_log().matches(SUBMITTED).count() == jobs_before {
            assert!(t0.elapsed() < COMMAND_LIMIT, "no job reached the scheduler");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(500));
        let victim = cluster.executors[1].take();
        let at = Instant::now();
        drop(victim); // kill -9 and reap
        (at, cluster)
    });
    let out = output_within_limit(&mut query, "exposure with an executor killed");
    let finished = Instant::now();
    let (t0, _cluster) = killer.join().expect("killer");
    assert!(
        finished > t0,
        "the query was still running when the executor was killed"
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    if out.status.success() {
        assert_eq!(stdout, synth_answer, "completed: the same answer");
        eprintln!(
            "executor killed mid-query: completed correctly on the survivor ({:.1} s after the kill)",
            finished.duration_since(t0).as_secs_f64()
        );
    } else {
        assert!(
            !stdout.contains("# summary"),
            "a failed query prints no answer: {stdout}"
        );
        assert!(stderr.contains("error:"), "a clear error: {stderr}");
        eprintln!(
            "executor killed mid-query: failed after {:.1} s with: {}",
            finished.duration_since(t0).as_secs_f64(),
            stderr.lines().last().unwrap_or_default()
        );
    }
}

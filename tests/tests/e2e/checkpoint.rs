//! A node's tail cannot be cut silently: signed checkpoints kept where the node's own disk cannot
//! rewrite them — another node's log (the peer's, the eBPF witness's), another directory, an
//! object store — show a chain that ends before them. Each place is tested against the attacker
//! who controls the node's disk: who deletes the newest sealing (its digest and every file it
//! names) *and* the root's own copy of the checkpoint.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use custody_audit::checkpoint::{Checkpoint, CheckpointSink, DirSink, LogSink};
use custody_audit::digest::{self, Expect, Freshness, Problem, SigningKey};
use custody_audit::writer::{AuditWriter, WriterConfig};
use custody_audit::{AuditSink, Event, PageKind};

use crate::audit::tmp_dir;

const NODE: u32 = 1;
const PEER: u32 = 2;
const WITNESS: u32 = 9;

/// Node `NODE` seals three segments; every checkpoint also goes to `sinks`.
pub(crate) fn node_log(root: &Path, key: &SigningKey, sinks: Vec<Arc<dyn CheckpointSink>>) {
    let mut cfg = WriterConfig::new(root, NODE, key.clone());
    cfg.checkpoint_sinks = sinks;
    let w = AuditWriter::open(cfg).expect("writer");
    for seg in 0..3u64 {
        for i in 0..50u64 {
            w.record(Event::Page {
                ts_ns: custody_audit::mono_now_ns(),
                request: seg * 100 + i,
                tenant: "acme".into(),
                page: (i % 5) as u32,
                generation: 1,
                kind: PageKind::Alloc,
            })
            .expect("record");
        }
        w.rotate().expect("seal");
    }
    w.close().expect("close");
}

/// Another node's writer in the same root (a peer, or the witness with its own node id).
fn other_log(root: &Path, node: u32, key: &SigningKey) -> Arc<AuditWriter> {
    Arc::new(AuditWriter::open(WriterConfig::new(root, node, key.clone())).expect("writer"))
}

/// The attacker with `NODE`'s disk: the newest digest and every file it names go, and (when
/// `local_copy_too`) the root's own checkpoint copy.
pub(crate) fn cut_tail(root: &Path, local_copy_too: bool) {
    let dir = root.join(format!("_digests/node={NODE}"));
    let mut digests: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("digests")
        .map(|e| e.expect("entry").path())
        .collect();
    digests.sort();
    let newest = digests.pop().expect("a digest");
    let d: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&newest).expect("read")).expect("json");
    for f in d["files"].as_array().expect("files") {
        std::fs::remove_file(root.join(f["path"].as_str().expect("path"))).expect("rm file");
    }
    std::fs::remove_file(&newest).expect("rm digest");
    // The tree as the shortened chain makes it: its tiles are hashes of the records anyone can
    // recompute; its signed note (which only the node can sign) deleted, not forged.
    let tlog = root.join(format!("_tlog/node={NODE}"));
    std::fs::remove_dir_all(&tlog).expect("rm tree");
    custody_audit::tree_store::rebuild(root, NODE).expect("rebuild the tiles");
    if local_copy_too {
        std::fs::remove_file(DirSink::path(&root.join("_checkpoints"), NODE)).expect("rm copy");
    }
}

fn verify(root: &Path, key: &SigningKey, expect: &Expect) -> digest::Report {
    digest::verify_reporting(
        &digest::LocalStore::new(root),
        Some(&key.verifying_key()),
        None,
        None,
        expect,
    )
}

pub(crate) fn tail_cut(r: &digest::Report) -> Option<String> {
    r.problems.iter().find_map(|p| match p {
        Problem::TailCut {
            node: NODE,
            checkpoint_digest_seq: 2,
            last_present: Some(1),
            place,
        } => Some(place.clone()),
        _ => None,
    })
}

#[test]
fn a_cut_tail_is_found_from_every_place_a_checkpoint_lives() {
    let key = digest::generate_key().expect("key");

    // The root's own copy: enough against an attacker who forgets it, nothing against one who
    // does not (the documented limit without an outside checkpoint).
    let root = tmp_dir("cp-local");
    node_log(&root, &key, Vec::new());
    let clean = verify(&root, &key, &Expect::default());
    assert!(clean.ok(), "{:?}", clean.problems);
    assert!(clean.checkpoints >= 1);
    cut_tail(&root, false);
    let r = verify(&root, &key, &Expect::default());
    assert!(
        tail_cut(&r).is_some_and(|p| p.contains("_checkpoints")),
        "{:?}",
        r.problems
    );
    std::fs::remove_file(DirSink::path(&root.join("_checkpoints"), NODE)).expect("rm copy");
    let r = verify(&root, &key, &Expect::default());
    assert!(
        r.ok(),
        "without an outside checkpoint a clean cut verifies: {:?}",
        r.problems
    );

    // The peer's and the witness's logs: each keeps the node's checkpoints in its own signed
    // chain; verifying the shared root finds them there.
    for (other, name) in [(PEER, "peer"), (WITNESS, "witness")] {
        let root = tmp_dir(&format!("cp-{name}"));
        let other_key = digest::generate_key().expect("key");
        let log = other_log(&root, other, &other_key);
        node_log(&root, &key, vec![Arc::new(LogSink::new(log.clone(), name))]);
        log.close().expect("seal the other log");
        let r = verify(&root, &key, &Expect::default());
        assert!(
            r.problems
                .iter()
                .all(|p| matches!(p, Problem::BadSignature { .. } | Problem::WrongKey { .. })),
            "only the other log's key differs from the expected one: {:?}",
            r.problems
        );
        cut_tail(&root, true);
        let r = digest::verify(&root, None, None, None);
        let place = tail_cut(&r).unwrap_or_else(|| panic!("{name}: {:?}", r.problems));
        // The same with every key pinned: the node's for all, the other log's for its node.
        let pinned = Expect {
            node_keys: [(other, other_key.verifying_key())].into(),
            ..Expect::default()
        };
        let r = verify(&root, &key, &pinned);
        assert!(
            tail_cut(&r).is_some(),
            "{name}, keys pinned: {:?}",
            r.problems
        );
        assert!(
            r.problems
                .iter()
                .all(|p| matches!(p, Problem::TailCut { .. })),
            "{name}, keys pinned: {:?}",
            r.problems
        );
        assert!(
            place.contains("node_events") && place.contains(&format!("node={other}")),
            "{place}"
        );
    }

    // Another directory (another disk or mount), given to verify.
    let root = tmp_dir("cp-dir");
    let outside = tmp_dir("cp-dir-outside");
    node_log(&root, &key, vec![Arc::new(DirSink::new(&outside))]);
    cut_tail(&root, true);
    let file = DirSink::path(&outside, NODE);
    let cp = Checkpoint::parse(&std::fs::read_to_string(&file).expect("read")).expect("parse");
    let expect = Expect {
        checkpoints: vec![(cp, file.display().to_string())],
        ..Expect::default()
    };
    let r = verify(&root, &key, &expect);
    assert!(
        tail_cut(&r).is_some_and(|p| p.contains("cp-dir-outside")),
        "{:?}",
        r.problems
    );
    for d in [root, outside] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn rewritten_missing_stale_and_empty_logs_are_reported() {
    let key = digest::generate_key().expect("key");
    let root = tmp_dir("cp-rewritten");
    node_log(&root, &key, Vec::new());
    // The newest digest re-serialised: still validly signed (the signature covers its fields),
    // but not the file the checkpoint hashed.
    let newest = root.join(format!("_digests/node={NODE}/0000000000000002.json"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&newest).expect("read")).expect("json");
    std::fs::write(&newest, serde_json::to_vec(&v).expect("compact")).expect("write");
    let r = verify(&root, &key, &Expect::default());
    assert!(
        r.problems
            == [Problem::CheckpointMismatch {
                node: NODE,
                digest_seq: 2,
                place: r.newest_checkpoints[&NODE].clone()
            }],
        "{:?}",
        r.problems
    );

    // A node that must be there and is not; a log whose newest evidence is too old.
    let root = tmp_dir("cp-stale");
    node_log(&root, &key, Vec::new());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as i64;
    let fresh = Expect {
        nodes: vec![NODE],
        freshness: Some(Freshness {
            now_wall_ns: now,
            max_age: std::time::Duration::from_secs(600),
        }),
        ..Expect::default()
    };
    assert!(verify(&root, &key, &fresh).ok());
    let later = Expect {
        nodes: vec![NODE, 5],
        freshness: Some(Freshness {
            now_wall_ns: now + 3_600_000_000_000,
            max_age: std::time::Duration::from_secs(600),
        }),
        ..Expect::default()
    };
    let r = verify(&root, &key, &later);
    assert!(
        r.problems.contains(&Problem::NodeMissing { node: 5 }),
        "{:?}",
        r.problems
    );
    assert!(
        r.problems.iter().any(|p| matches!(
            p,
            Problem::Stale {
                node: NODE,
                last_evidence_wall_ns: Some(_),
                max_age_s: 600
            }
        )),
        "{:?}",
        r.problems
    );
    assert!(r.problems.iter().any(|p| matches!(
        p,
        Problem::Stale {
            node: 5,
            last_evidence_wall_ns: None,
            ..
        }
    )));

    // An empty root verifies as nothing, never as OK.
    let empty = tmp_dir("cp-empty");
    let r = verify(&empty, &key, &Expect::default());
    assert_eq!(r.problems, [Problem::EmptyRoot]);
    for d in [root, empty] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// An idle node still says where it stands: checkpoints at the interval without any seal.
#[test]
fn an_idle_writer_publishes_checkpoints_on_its_interval() {
    let key = digest::generate_key().expect("key");
    let root = tmp_dir("cp-idle");
    let outside = tmp_dir("cp-idle-outside");
    let mut cfg = WriterConfig::new(&root, NODE, key.clone());
    cfg.checkpoint_interval = std::time::Duration::from_millis(100);
    cfg.checkpoint_sinks = vec![Arc::new(DirSink::new(&outside))];
    let w = AuditWriter::open(cfg).expect("writer");
    let file = DirSink::path(&outside, NODE);
    let issued = |f: &Path| {
        Checkpoint::parse(&std::fs::read_to_string(f).expect("read"))
            .expect("parse")
            .body
            .issued_wall_ns
    };
    let t0 = std::time::Instant::now();
    while !file.exists() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "no checkpoint at start"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let first = issued(&file);
    while issued(&file) == first {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "no checkpoint while idle"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let cp = Checkpoint::parse(&std::fs::read_to_string(&file).expect("read")).expect("parse");
    assert_eq!(
        (cp.body.digest_seq, cp.body.seq_end),
        (None, 0),
        "nothing sealed yet"
    );
    cp.verify(Some(&key.verifying_key())).expect("signed");
    w.close().expect("close");
    for d in [root, outside] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The attacker cuts `NODE`'s tail (and the root's copy); the witness's log shows it.
fn cut_tail_shows_in_the_witness_log(root: &Path) {
    cut_tail(root, true);
    let r = digest::verify(root, None, None, None);
    let place = tail_cut(&r).unwrap_or_else(|| panic!("{:?}", r.problems));
    assert!(
        place.contains(&format!("node_events/node={WITNESS}")),
        "{place}"
    );
}

/// The relay `custody probe --checkpoints-from` (and a peer's `[audit] checkpoints_from`) runs
/// when the node is another process: the node publishes into a directory, the relay keeps each
/// new checkpoint in the witness's log, where the cut tail shows.
#[test]
fn a_relayed_checkpoint_in_the_witness_log_catches_a_cut_tail() {
    use custody_audit::checkpoint::Relay;
    let key = digest::generate_key().expect("key");
    let root = tmp_dir("cp-relay");
    let published = tmp_dir("cp-relay-published");
    let witness = other_log(&root, WITNESS, &digest::generate_key().expect("key"));
    let mut relay = Relay::new(&published, witness.clone());
    assert_eq!(relay.poll().expect("poll"), 0, "nothing published yet");
    node_log(&root, &key, vec![Arc::new(DirSink::new(&published))]);
    assert_eq!(
        relay.poll().expect("poll"),
        1,
        "the newest checkpoint of node {NODE}"
    );
    assert_eq!(relay.poll().expect("poll"), 0, "nothing new");
    witness.close().expect("seal the witness log");
    cut_tail_shows_in_the_witness_log(&root);
    for d in [root, published] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// The attacker with node `node`'s disk deletes every sealing from digest `from` on (digests and
/// the files they name) and the root's own copy of its checkpoint.
fn cut_from(root: &Path, node: u32, from: u64) {
    let dir = root.join(format!("_digests/node={node}"));
    for e in std::fs::read_dir(&dir).expect("digests") {
        let path = e.expect("entry").path();
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        if d["digest_seq"].as_u64().expect("digest_seq") < from {
            continue;
        }
        for f in d["files"].as_array().expect("files") {
            std::fs::remove_file(root.join(f["path"].as_str().expect("path"))).expect("rm file");
        }
        std::fs::remove_file(&path).expect("rm digest");
    }
    std::fs::remove_file(DirSink::path(&root.join("_checkpoints"), node)).expect("rm copy");
}

/// Node `node`'s newest checkpoint has sealed digest `seq` (or a later one).
fn issued_after(latest: &custody_audit::checkpoint::Latest, seq: u64) -> bool {
    latest
        .get()
        .is_some_and(|cp| cp.body.digest_seq.is_some_and(|s| s >= seq))
}

/// Whether `mem` holds a kept checkpoint of `node` vouching for digest `seq`.
fn kept(mem: &custody_audit::MemorySink, node: u32, seq: u64) -> bool {
    mem.events.lock().expect("events").iter().any(|e| match e {
        Event::Node { kind, detail, .. }
            if &**kind == custody_audit::checkpoint::NODE_EVENT_KIND =>
        {
            Checkpoint::parse(detail).is_ok_and(|cp| {
                cp.body.node == node && cp.body.digest_seq.is_some_and(|s| s >= seq)
            })
        }
        _ => false,
    })
}

/// A running pair keeps each other's checkpoints over its control plane
/// (`Decode.ExchangeCheckpoints`, real gRPC on loopback): the attacker with one node's disk who
/// cuts its log from the newest checkpointed sealing on, and deletes the root's copy, is found
/// from the other node's sealed log — in both directions.
#[test]
fn a_pair_keeps_each_others_checkpoints_and_a_cut_tail_shows() {
    use custody_audit::checkpoint::{Latest, PeerExchange};
    use custody_runtime::config::UnsafeReproduction;
    use custody_runtime::disagg::checkpoints::PeerCheckpoints;
    use std::time::{Duration, Instant};
    const PREFILL: u32 = 1;
    const DECODE: u32 = 2;
    let key = digest::generate_key().expect("key");
    let root = tmp_dir("cp-pair");
    let open = |node| {
        let latest = Arc::new(Latest::default());
        let mut cfg = WriterConfig::new(&root, node, key.clone());
        cfg.checkpoint_interval = Duration::from_millis(200);
        cfg.checkpoint_sinks = vec![latest.clone()];
        (Arc::new(AuditWriter::open(cfg).expect("writer")), latest)
    };
    let ((pw, platest), (dw, dlatest)) = (open(PREFILL), open(DECODE));
    // What each node keeps of the other's also goes to memory, to see when it arrived.
    let (pmem, dmem) = (
        custody_audit::MemorySink::default(),
        custody_audit::MemorySink::default(),
    );
    let side =
        |node: u32, own: &Arc<Latest>, w: &Arc<AuditWriter>, mem: &custody_audit::MemorySink| {
            let log = Arc::new(crate::disagg::Tee(
                mem.clone(),
                Some(w.clone() as Arc<dyn AuditSink>),
            ));
            PeerCheckpoints {
                book: Arc::new(PeerExchange::new(own.clone(), log, node, "peer")),
                interval: Duration::from_millis(100),
            }
        };
    let peers = (
        side(PREFILL, &platest, &pw, &pmem),
        side(DECODE, &dlatest, &dw, &dmem),
    );
    let nodes = crate::disagg::start_pair_exchanging(
        crate::small_cfg(),
        crate::small_cfg(),
        UnsafeReproduction::default(),
        Duration::from_secs(30),
        Some((pw.clone(), dw.clone())),
        Some(peers),
    );
    let out = nodes
        .pair
        .generate(&crate::disagg::req("acme", vec![1, 2, 3, 4, 5, 6, 7, 8], 4))
        .expect("served");
    assert_eq!(out.tokens.len(), 4);
    // Each node seals its traffic (digest 1, after the start's digest 0 or its first seal),
    // then waits until the other has kept a checkpoint vouching for it.
    pw.rotate().expect("seal prefill");
    dw.rotate().expect("seal decode");
    let newest = |node: u32| {
        std::fs::read_dir(root.join(format!("_digests/node={node}")))
            .expect("digests")
            .count() as u64
            - 1
    };
    let (p_seq, d_seq) = (newest(PREFILL), newest(DECODE));
    let t0 = Instant::now();
    while !(issued_after(&platest, p_seq)
        && issued_after(&dlatest, d_seq)
        && kept(&pmem, DECODE, d_seq)
        && kept(&dmem, PREFILL, p_seq))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no exchange: prefill kept {}, decode kept {}",
            kept(&pmem, DECODE, d_seq),
            kept(&dmem, PREFILL, p_seq)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(nodes);
    pw.close().expect("close prefill");
    dw.close().expect("close decode");
    let clean = verify(&root, &key, &Expect::default());
    assert!(clean.ok(), "{:?}", clean.problems);

    for (cut, from, keeper) in [(DECODE, d_seq, PREFILL), (PREFILL, p_seq, DECODE)] {
        let copy = tmp_dir(&format!("cp-pair-cut-{cut}"));
        let status = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", root.display()))
            .arg(&copy)
            .status()
            .expect("cp");
        assert!(status.success());
        cut_from(&copy, cut, from);
        let r = verify(&copy, &key, &Expect::default());
        let place = r
            .problems
            .iter()
            .find_map(|p| match p {
                Problem::TailCut {
                    node,
                    checkpoint_digest_seq,
                    last_present,
                    place,
                } if *node == cut
                    && *checkpoint_digest_seq >= from
                    && last_present.is_none_or(|l| l < from) =>
                {
                    Some(place.clone())
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("node {cut}'s cut tail not found: {:?}", r.problems));
        assert!(
            place.contains(&format!("node_events/node={keeper}")),
            "node {cut}'s checkpoint should be found in node {keeper}'s log: {place}"
        );
        let _ = std::fs::remove_dir_all(&copy);
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// `custody probe --checkpoints-from DIR` (the binary as an operator runs it, attached to this
/// test process): the witness's own log keeps the checkpoints the node publishes into `DIR`, and
/// the node's cut tail shows against it.
#[test]
fn the_probe_binary_keeps_a_nodes_checkpoints_in_the_witness_log() {
    if !custody_ebpf::require_bpf_or_skip("e2e::checkpoint::probe_binary") {
        return;
    }
    let key = digest::generate_key().expect("key");
    let root = tmp_dir("cp-probe");
    let published = tmp_dir("cp-probe-published");
    let keys = tmp_dir("cp-probe-key");
    let key_file = keys.join("witness.key");
    digest::write_key(&digest::generate_key().expect("key"), &key_file).expect("key file");
    node_log(&root, &key, vec![Arc::new(DirSink::new(&published))]);
    let out = std::process::Command::new(crate::symbols::default_features_binary())
        .args([
            "probe",
            "--pid",
            &std::process::id().to_string(),
            "--duration-s",
            "2",
        ])
        .args(["--node", &WITNESS.to_string(), "--audit"])
        .arg(&root)
        .arg("--audit-key")
        .arg(&key_file)
        .arg("--checkpoints-from")
        .arg(&published)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run custody probe (scripts/test.sh builds it)");
    assert!(
        out.status.success(),
        "custody probe: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    cut_tail_shows_in_the_witness_log(&root);
    for d in [root, published, keys] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Every path under `root` that belongs to `node` (`…/node=<n>/…` partitions and digests, the
/// root's own checkpoint copy `node=<n>.json`): its whole log.
fn delete_node_log(root: &Path, node: u32) -> usize {
    fn walk(dir: &Path, name: &str, json: &str, n: &mut usize) {
        for e in std::fs::read_dir(dir).expect("read_dir") {
            let p = e.expect("entry").path();
            let f = p.file_name().and_then(|f| f.to_str()).unwrap_or_default();
            if f == name {
                std::fs::remove_dir_all(&p).expect("rm node dir");
                *n += 1;
            } else if f == json {
                std::fs::remove_file(&p).expect("rm checkpoint copy");
                *n += 1;
            } else if p.is_dir() {
                walk(&p, name, json, n);
            }
        }
    }
    let mut n = 0;
    walk(
        root,
        &format!("node={node}"),
        &format!("node={node}.json"),
        &mut n,
    );
    n
}

/// A pair's root with one key for both nodes: the peer's log keeps the decode node's start-up
/// checkpoint (issued before its first seal: `digest_seq` null). The decode node's whole log
/// deleted, `--expect-node` must report it missing — that checkpoint vouches for no sealed data
/// (and with a shared key any node could have signed it).
#[test]
fn a_deleted_node_is_missing_though_a_peer_kept_its_start_up_checkpoint() {
    const DECODE: u32 = 3;
    let key = digest::generate_key().expect("key");
    let root = tmp_dir("cp-deleted-node");
    let peer = other_log(&root, PEER, &key);
    // What the exchange at start hands the peer: the decode node's checkpoint before any seal.
    let start_up = Checkpoint::sign(&digest::ChainHead::default(), DECODE, 1, &key);
    assert_eq!(start_up.body.digest_seq, None);
    LogSink::new(peer.clone(), "peer")
        .publish(&start_up)
        .expect("kept in the peer's log");
    // The decode node's own log: sealed segments and checkpoints of its own.
    let w = AuditWriter::open(WriterConfig::new(&*root, DECODE, key.clone())).expect("writer");
    for i in 0..20u64 {
        w.record(Event::Page {
            ts_ns: custody_audit::mono_now_ns(),
            request: i,
            tenant: "acme".into(),
            page: (i % 4) as u32,
            generation: 1,
            kind: PageKind::Alloc,
        })
        .expect("record");
    }
    w.close().expect("seal");
    peer.close().expect("seal the peer's log");
    let expect = Expect {
        nodes: vec![PEER, DECODE],
        ..Expect::default()
    };
    let r = verify(&root, &key, &expect);
    assert!(r.ok(), "both logs there: {:?}", r.problems);

    assert!(delete_node_log(&root, DECODE) >= 2, "a log to delete");
    let r = verify(&root, &key, &expect);
    assert_eq!(
        r.problems,
        [Problem::NodeMissing { node: DECODE }],
        "{:?}",
        r.problems
    );

    // The command says so, naming the node, and exits non-zero.
    let keys = tmp_dir("cp-deleted-node-key");
    let public = digest::write_key(&key, &keys.join("audit.key")).expect("key file");
    let out = std::process::Command::new(crate::symbols::default_features_binary())
        .args(["audit", "verify"])
        .arg(&*root)
        .arg("--public-key")
        .arg(&public)
        .args(["--expect-node", &PEER.to_string()])
        .args(["--expect-node", &DECODE.to_string()])
        .output()
        .expect("run custody (scripts/test.sh builds target/default-features/custody)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!("node {DECODE} is MISSING")),
        "{stdout}"
    );
}

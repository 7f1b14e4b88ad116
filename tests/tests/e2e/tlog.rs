//! The Merkle tree over each node's log (issue 40): written at every seal, rebuilt by `verify`
//! from the sealed records alone, and every way of tampering with it found.

use std::path::Path;

use custody_audit::digest::{self, DigestFile, Problem};
use custody_audit::tlog::Hash;
use custody_audit::tree_store::TreeStatus;
use custody_audit::writer::{AuditWriter, WriterConfig};
use custody_audit::{AuditSink, Event as AEvent, PageKind};
use ed25519_dalek::Signer as _;

use crate::audit::{build_log, copy_dir, key, tmp_dir};

const NODE: u32 = 3;

fn digest_paths(root: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(root.join(format!("_digests/node={NODE}")))
        .expect("digests")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    v.sort();
    v
}

/// Re-signs a node's whole chain after `edit` changed each digest's body (an attacker, or a
/// migration test, holding the node's key).
fn resign_chain(root: &Path, k: &ed25519_dalek::SigningKey, edit: &dyn Fn(&mut DigestFile)) {
    let mut prev: Option<(String, String)> = None;
    for p in digest_paths(root) {
        let mut d: DigestFile =
            serde_json::from_slice(&std::fs::read(&p).expect("read")).expect("digest");
        edit(&mut d);
        if let Some((sha, sig)) = &prev {
            d.body.previous_digest_sha256 = Some(sha.clone());
            d.body.previous_signature = Some(sig.clone());
        }
        let canonical = serde_json::to_vec(&d.body).expect("json");
        d.signature = digest::hex(&k.sign(&canonical).to_bytes());
        let bytes = serde_json::to_vec_pretty(&d).expect("json");
        std::fs::write(&p, &bytes).expect("write");
        use sha2::Digest as _;
        prev = Some((
            digest::hex(&sha2::Sha256::digest(&bytes)),
            d.signature.clone(),
        ));
    }
}

fn tree_of(r: &digest::Report) -> TreeStatus {
    r.trees.get(&NODE).cloned().expect("the node's tree")
}

#[test]
fn the_tree_is_rebuilt_from_the_records_and_every_tampering_with_it_is_found() {
    let base = tmp_dir("tlog-base");
    let k = key();
    build_log(&base, &k);
    let vk = k.0.verifying_key();
    let clean = digest::verify(&base, Some(&vk), None, None);
    assert!(clean.ok(), "{:?}", clean.problems);
    let last: DigestFile = serde_json::from_slice(
        &std::fs::read(digest_paths(&base).last().expect("a digest")).expect("read"),
    )
    .expect("digest");
    let size = last.body.seq_end;
    assert!(size > 3 * 256, "the log spans several full tiles ({size})");
    match tree_of(&clean) {
        TreeStatus::Checked {
            size: s,
            root,
            checkpoint_size,
            witnessed_size: None,
        } => {
            assert_eq!(s, size);
            assert_eq!(Some(root), last.body.tree_root);
            assert_eq!(checkpoint_size, Some(size));
        }
        other => panic!("tree not checked: {other:?}"),
    }
    // A windowed verification says it did not rebuild the tree (it covers the whole log).
    let windowed = digest::verify(&base, Some(&vk), Some(0), None);
    assert!(matches!(tree_of(&windowed), TreeStatus::NotChecked(_)));

    let tlog = |d: &Path| d.join(format!("_tlog/node={NODE}"));
    // The writer leaves the full level-0 tiles out by default (recomputable from the records);
    // `custody audit tiles` writes them, and then they are held to the records too.
    assert!(!tlog(&base).join("tile/0/000").exists());
    assert!(tlog(&base).join("tile/1/000.p").exists());
    custody_audit::tree_store::rebuild(&base, NODE).expect("every tile");
    assert!(tlog(&base).join("tile/0/000").exists());
    let again = digest::verify(&base, Some(&vk), None, None);
    assert!(again.ok(), "{:?}", again.problems);
    let case = |name: &str, tamper: &dyn Fn(&Path), check: &dyn Fn(&[Problem]) -> bool| {
        let d = tmp_dir(&format!("tlog-{name}"));
        copy_dir(&base, &d);
        tamper(&d);
        let r = digest::verify(&d, Some(&vk), None, None);
        assert!(!r.ok(), "{name}: tampering not detected");
        assert!(
            check(&r.problems),
            "{name}: wrong findings {:?}",
            r.problems
        );
        for p in &r.problems {
            assert!(!p.to_string().is_empty());
        }
    };
    case(
        "tile-flip",
        &|d| {
            let f = tlog(d).join("tile/0/001");
            let mut b = std::fs::read(&f).expect("read");
            b[100] ^= 1;
            std::fs::write(&f, b).expect("write");
        },
        &|p| matches!(p, [Problem::TileModified { .. }]),
    );
    case(
        "tile-delete",
        &|d| std::fs::remove_dir_all(tlog(d).join("tile/1")).expect("rm"),
        &|p| matches!(p, [Problem::TileMissing { .. }]),
    );
    case(
        "partial-tile-delete",
        &|d| {
            std::fs::remove_dir_all(tlog(d).join(format!("tile/0/{:03}.p", size / 256)))
                .expect("rm")
        },
        &|p| matches!(p, [Problem::TileMissing { .. }]),
    );
    // The node's own key signs a checkpoint of another history (a fork): its root is not the
    // sealed records'.
    case(
        "forked-checkpoint",
        &|d| {
            let origin = custody_audit::tree_store::default_origin(NODE, &vk);
            let signer =
                custody_audit::tlog::NoteSigner::new(&origin, k.0.clone()).expect("signer");
            let forged =
                custody_audit::tlog::sign_checkpoint(&signer, size, Hash([7; 32])).expect("sign");
            std::fs::write(tlog(d).join("checkpoint"), forged).expect("write");
        },
        &|p| matches!(p, [Problem::TreeCheckpointInvalid { .. }]),
    );
    case(
        "checkpoint-other-key",
        &|d| {
            let other = key();
            let origin = custody_audit::tree_store::default_origin(NODE, &vk);
            let signer =
                custody_audit::tlog::NoteSigner::new(&origin, other.0.clone()).expect("signer");
            let root = Hash(last.body.tree().expect("a tree").root);
            let forged = custody_audit::tlog::sign_checkpoint(&signer, size, root).expect("sign");
            std::fs::write(tlog(d).join("checkpoint"), forged).expect("write");
        },
        &|p| matches!(p, [Problem::TreeCheckpointInvalid { .. }]),
    );
    // The newest sealing deleted, the tiles recomputed for what remains (anyone can), the
    // node's signed note left: it names a tree no remaining digest sealed.
    case(
        "cut-tail-note-left",
        &|d| {
            let newest = digest_paths(d).pop().expect("a digest");
            let dg: DigestFile =
                serde_json::from_slice(&std::fs::read(&newest).expect("read")).expect("digest");
            for f in &dg.body.files {
                std::fs::remove_file(d.join(&f.path)).expect("rm file");
            }
            std::fs::remove_file(&newest).expect("rm digest");
            std::fs::remove_dir_all(d.join("_checkpoints")).expect("rm copies");
            let note = std::fs::read(tlog(d).join("checkpoint")).expect("note");
            std::fs::remove_dir_all(tlog(d)).expect("rm tree");
            custody_audit::tree_store::rebuild(d, NODE).expect("rebuild");
            std::fs::write(tlog(d).join("checkpoint"), note).expect("note back");
        },
        &|p| matches!(p, [Problem::TreeCheckpointInvalid { .. }]),
    );
    // A chain re-signed by the node's key that drops the tree from its newest digest.
    case(
        "tree-dropped",
        &|d| {
            let n = digest_paths(d).len();
            let count = std::cell::Cell::new(0);
            resign_chain(d, &k.0, &|dg| {
                count.set(count.get() + 1);
                if count.get() == n {
                    dg.body.tree_size = None;
                    dg.body.tree_root = None;
                }
            });
        },
        &|p| p.iter().any(|x| matches!(x, Problem::TreeMismatch { .. })),
    );
    // A chain re-signed with a root that is not the records' (a history rewritten under the
    // key, tiles and all: the records still say otherwise).
    case(
        "root-rewritten",
        &|d| {
            resign_chain(d, &k.0, &|dg| dg.body.tree_root = Some("ab".repeat(32)));
        },
        &|p| p.iter().any(|x| matches!(x, Problem::TreeMismatch { .. })),
    );
}

/// A log sealed before the tree existed verifies as before (no tree), and the next writer on
/// it rebuilds the tree from its sealed files and carries it on.
#[test]
fn a_log_sealed_before_the_tree_gets_one_on_its_next_start() {
    let root = tmp_dir("tlog-migrate");
    let k = key();
    build_log(&root, &k);
    resign_chain(&root, &k.0, &|d| {
        d.body.tree_size = None;
        d.body.tree_root = None;
    });
    std::fs::remove_dir_all(root.join("_tlog")).expect("rm");
    // The old writer's checkpoints hashed the digests before this test rewrote them.
    std::fs::remove_dir_all(root.join("_checkpoints")).expect("rm");
    let vk = k.0.verifying_key();
    let old = digest::verify(&root, Some(&vk), None, None);
    assert!(old.ok(), "{:?}", old.problems);
    assert_eq!(tree_of(&old), TreeStatus::Absent);

    let w = AuditWriter::open(WriterConfig::new(&*root, NODE, k.0.clone())).expect("writer");
    for i in 0..10u64 {
        w.record(AEvent::Page {
            ts_ns: custody_audit::mono_now_ns(),
            request: 9000 + i,
            tenant: "t9".into(),
            page: 1,
            generation: 1,
            kind: PageKind::Alloc,
        })
        .expect("record");
    }
    w.close().expect("close");
    let new = digest::verify(&root, Some(&vk), None, None);
    assert!(new.ok(), "{:?}", new.problems);
    let TreeStatus::Checked {
        size,
        checkpoint_size,
        ..
    } = tree_of(&new)
    else {
        panic!("not rebuilt: {:?}", tree_of(&new));
    };
    assert!(size > 1200, "{size}");
    assert_eq!(checkpoint_size, Some(size));
}

/// `custody audit tiles` writes every tile (level 0 included) and `custody audit verify` says
/// the tree was rebuilt from the records and agrees with the tiles and the signed note.
#[test]
fn the_cli_writes_every_tile_and_verify_reports_the_tree() {
    let root = tmp_dir("tlog-cli");
    let k = key();
    build_log(&root, &k);
    let pubkey = root.join("node.pub");
    std::fs::write(&pubkey, digest::hex(k.0.verifying_key().as_bytes())).expect("pub");
    let run = |args: &[&str]| {
        let o = crate::cli::custody(args);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "{args:?}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    };
    let r = root.to_str().expect("utf-8");
    let out = run(&["audit", "tiles", r]);
    assert!(out.contains(&format!("node {NODE}: ")), "{out}");
    assert!(root.join(format!("_tlog/node={NODE}/tile/0/000")).exists());
    let out = run(&[
        "audit",
        "verify",
        r,
        "--public-key",
        pubkey.to_str().expect("utf-8"),
    ]);
    assert!(
        out.contains("Merkle tree of") && out.contains("rebuilt from the sealed records"),
        "{out}"
    );
    assert!(out.contains("audit log verified: OK"), "{out}");
}

/// Inclusion proofs of records at tile edges and consistency proofs from every sealed size to
/// the newest, made from the root on disk (level-0 tiles recomputed from the records, then
/// read from `audit tiles`' files: the same proofs), check against the node's key; a proof
/// for altered record bytes, another index or another key does not.
#[test]
fn proofs_from_the_root_check_and_altered_ones_do_not() {
    use custody_audit::tlog::{self, InclusionProof};
    use custody_audit::tree_store::NodeLog;
    let root = tmp_dir("tlog-proofs");
    let k = key();
    build_log(&root, &k);
    let store = digest::LocalStore::new(&*root);
    let make = || {
        let log = NodeLog::open(&store, NODE).expect("log");
        let note = log.checkpoint_note().expect("note");
        let size = tlog::open_checkpoint(
            &note,
            &tlog::ed25519_vkey(
                &custody_audit::tree_store::default_origin(NODE, &k.0.verifying_key()),
                &k.0.verifying_key(),
            ),
        )
        .expect("signed by the node")
        .size();
        let seqs = [0, 1, 255, 256, 257, 511, 512, size / 2, size - 1];
        let proofs: Vec<InclusionProof> = seqs
            .iter()
            .map(|&s| InclusionProof {
                extra: Some(log.record(s).expect("record")),
                index: s,
                hashes: log.prove_inclusion(s, size).expect("prove"),
                checkpoint: note.clone(),
            })
            .collect();
        (log, size, proofs)
    };
    let vkey = tlog::ed25519_vkey(
        &custody_audit::tree_store::default_origin(NODE, &k.0.verifying_key()),
        &k.0.verifying_key(),
    );
    let (log, size, proofs) = make();
    for p in &proofs {
        let cp = p
            .verify(&vkey)
            .unwrap_or_else(|e| panic!("seq {}: {e}", p.index));
        assert_eq!(cp.size(), size);
        assert!(
            p.hashes.len() <= 64 - size.leading_zeros() as usize,
            "O(log n)"
        );
        // Through the text format and back.
        let back = InclusionProof::parse(&p.to_bytes()).expect("parse");
        back.verify(&vkey).expect("parsed proof");
        let record = custody_audit::leaf::decode_record(p.extra.as_deref().expect("extra"))
            .expect("a canonical record");
        let seq = record
            .columns
            .iter()
            .find(|(n, _)| n == "seq")
            .and_then(|(_, v)| v.clone());
        assert_eq!(seq, Some(custody_audit::leaf::Value::U64(p.index)));
    }
    let p = &proofs[3];
    let mut altered = p.clone();
    let last = altered.extra.as_mut().expect("extra").len() - 1;
    altered.extra.as_mut().expect("extra")[last] ^= 1;
    assert!(altered.verify(&vkey).is_err(), "altered record bytes");
    let mut moved = p.clone();
    moved.index += 1;
    assert!(moved.verify(&vkey).is_err(), "another index");
    let other = key();
    let other_vkey = tlog::ed25519_vkey(
        &custody_audit::tree_store::default_origin(NODE, &k.0.verifying_key()),
        &other.0.verifying_key(),
    );
    assert!(p.verify(&other_vkey).is_err(), "another key");
    // Consistency from every sealed size.
    let new_root = log.root_at(size).expect("root");
    let sizes: Vec<u64> = std::fs::read_dir(root.join(format!("_digests/node={NODE}")))
        .expect("digests")
        .flatten()
        .map(|e| {
            let d: DigestFile =
                serde_json::from_slice(&std::fs::read(e.path()).expect("read")).expect("digest");
            d.body.tree_size.expect("a tree")
        })
        .collect();
    assert!(sizes.len() >= 3);
    for &old in &sizes {
        let proof = log.prove_consistency(old, size).expect("consistency");
        let old_root = log.root_at(old).expect("old root");
        tlog::verify_consistency(&proof, size, new_root, old, old_root).expect("consistent");
        if old < size {
            assert!(
                tlog::verify_consistency(&proof, size, new_root, old, Hash([1; 32])).is_err(),
                "another old root"
            );
        }
    }
    // With every level-0 tile on disk the proofs are the same.
    drop(log);
    custody_audit::tree_store::rebuild(&root, NODE).expect("every tile");
    let (_, _, again) = make();
    assert_eq!(again, proofs);
}

/// `custody audit prove` and `check-proof` as a user runs them: a record's proof checks and
/// prints the record; a flipped hash fails with exit 1; a consistency proof from an earlier
/// checkpoint checks.
#[test]
fn the_cli_proves_and_checks() {
    let root = tmp_dir("tlog-cli-prove");
    let k = key();
    let pubkey = root.join("node.pub");
    std::fs::write(&pubkey, digest::hex(k.0.verifying_key().as_bytes())).expect("pub");
    let audit = root.join("audit");
    let w = AuditWriter::open(WriterConfig::new(&audit, NODE, k.0.clone())).expect("writer");
    let page = |i: u64| AEvent::Page {
        ts_ns: custody_audit::mono_now_ns(),
        request: i,
        tenant: "acme".into(),
        page: 1,
        generation: 1,
        kind: PageKind::Alloc,
    };
    for i in 0..300 {
        w.record(page(i)).expect("record");
    }
    w.rotate().expect("seal");
    let old_note = root.join("old.checkpoint");
    std::fs::copy(
        audit.join(format!("_tlog/node={NODE}/checkpoint")),
        &old_note,
    )
    .expect("cp");
    for i in 300..700 {
        w.record(page(i)).expect("record");
    }
    w.close().expect("close");
    let run = |args: &[&str]| crate::cli::custody(args);
    let s = |p: &Path| p.to_str().expect("utf-8").to_owned();
    let node = NODE.to_string();
    let proof = root.join("r.tlog-proof");
    let o = run(&[
        "audit",
        "prove",
        &s(&audit),
        "--node",
        &node,
        "--seq",
        "299",
        "--out",
        &s(&proof),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&proof).expect("proof");
    assert!(text.starts_with("c2sp.org/tlog-proof@v1\nextra "), "{text}");
    let o = run(&[
        "audit",
        "check-proof",
        &s(&proof),
        "--public-key",
        &s(&pubkey),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("proof OK: record 299"),
        "{out}"
    );
    assert!(out.contains("tenant = \"acme\""), "{out}");
    // Flip one character of the first proof hash.
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let h = &mut lines[3];
    let c = if h.starts_with('A') { "B" } else { "A" };
    h.replace_range(0..1, c);
    std::fs::write(&proof, lines.join("\n") + "\n").expect("write");
    let o = run(&[
        "audit",
        "check-proof",
        &s(&proof),
        "--public-key",
        &s(&pubkey),
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("proof FAILED"));
    // Consistency from the checkpoint kept after the first seal.
    let cons = root.join("c.proof");
    let o = run(&[
        "audit",
        "prove",
        &s(&audit),
        "--node",
        &node,
        "--old",
        "300",
        "--out",
        &s(&cons),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(&[
        "audit",
        "check-proof",
        &s(&cons),
        "--public-key",
        &s(&pubkey),
        "--old-checkpoint",
        &s(&old_note),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("extends the one of 300"),
        "{out}"
    );
}

/// `custody witness serve` as a process, on a free port; killed when dropped.
pub(crate) struct WitnessProc {
    child: std::process::Child,
    pub(crate) addr: String,
}

impl Drop for WitnessProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn start_witness(key: &Path, name: &str, state: &Path, logs: &[String]) -> WitnessProc {
    use std::io::BufRead as _;
    let mut cmd = std::process::Command::new(crate::symbols::default_features_binary());
    cmd.args([
        "witness",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--name",
        name,
    ])
    .arg("--key")
    .arg(key)
    .arg("--state")
    .arg(state)
    .env("RUST_LOG", "warn")
    .stdout(std::process::Stdio::piped());
    for l in logs {
        cmd.args(["--log", l]);
    }
    let mut child = cmd
        .spawn()
        .expect("custody witness serve (scripts/test.sh builds it)");
    let out = child.stdout.take().expect("stdout");
    let mut lines = std::io::BufReader::new(out).lines();
    let addr = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("listening on ").map(str::to_owned))
        .expect("the witness says where it listens");
    WitnessProc { child, addr }
}

/// A plain HTTP GET's body (the witness's monitoring endpoint).
fn http_get(addr: &str, path: &str) -> (u16, Vec<u8>) {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers")
        + 4;
    let status = String::from_utf8_lossy(&raw[9..12])
        .parse()
        .expect("status");
    (status, raw[end..].to_vec())
}

/// The split-view run: a node's checkpoints cosigned by a `custody witness` process as
/// the log grows; the node restarted from an older disk, then made to sign another history of
/// the same size with its own key. The witness refuses both (a smaller tree, then a second
/// root for a size it cosigned), keeps them as evidence (`custody witness evidence` shows both
/// checkpoints of each, signed by the node's key), and `audit verify --witness` holds the
/// forked disk to the witness's checkpoint and reports the fork, while the true log verifies.
#[test]
fn a_witness_cosigns_a_growing_log_and_refuses_a_forked_one() {
    use custody_audit::tree_store::{self, WitnessPolicy, WitnessTarget};
    use custody_server::tlog_witness::HttpTransport;
    let dir = tmp_dir("tlog-witness");
    let (k, wk) = (key(), key());
    let vk = k.0.verifying_key();
    let wkey = dir.join("witness.key");
    digest::write_key(&wk.0, &wkey).expect("witness key");
    let pubkey = dir.join("node.pub");
    std::fs::write(&pubkey, digest::hex(vk.as_bytes())).expect("pub");
    let origin = tree_store::default_origin(NODE, &vk);
    let node_vkey = custody_audit::tlog::ed25519_vkey(&origin, &vk);
    let state = dir.join("witness-state");
    let wp = start_witness(&wkey, "w1.test", &state, std::slice::from_ref(&node_vkey));
    let wvkey = custody_audit::cosign::vkey("w1.test", &wk.0.verifying_key());
    let targets = vec![WitnessTarget {
        url: format!("http://{}", wp.addr),
        vkey: wvkey.clone(),
    }];
    let page = |i: u64, tenant: &str| AEvent::Page {
        ts_ns: custody_audit::mono_now_ns(),
        request: i,
        tenant: tenant.to_owned().into(),
        page: 1,
        generation: 1,
        kind: PageKind::Alloc,
    };
    // A tenant's request of three records, and the promise its answer would carry.
    let answered = |w: &AuditWriter, request: u64| {
        let req = |kind| AEvent::Request {
            ts_ns: custody_audit::mono_now_ns(),
            request,
            tenant: "acme".into(),
            kind,
            prompt_tokens: 3,
            output_tokens: 2,
        };
        w.record(req(custody_audit::RequestKind::Admitted))
            .expect("record");
        w.record(page(request, "acme")).expect("record");
        w.record(req(custody_audit::RequestKind::Finished {
            reason: "stop".into(),
        }))
        .expect("record");
        match w.receipt_promise("acme", request).expect("promise") {
            custody_audit::writer::PromiseReply::Signed { note, .. } => note,
            other => panic!("request {request}: {other:?}"),
        }
    };
    let audit = dir.join("audit");
    let w = AuditWriter::open(WriterConfig::new(&audit, NODE, k.0.clone())).expect("writer");
    for i in 0..297 {
        w.record(page(i, "acme")).expect("record");
    }
    let kept_promise = answered(&w, 5000);
    w.rotate().expect("seal");
    let mut known = std::collections::BTreeMap::new();
    // A second witness that is down: the round fails for it alone, and says why.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let dead_url = format!("http://{}", dead.local_addr().expect("addr"));
    drop(dead);
    let with_dead = [
        targets[0].clone(),
        WitnessTarget {
            url: dead_url.clone(),
            vkey: wvkey.clone(),
        },
    ];
    let r = tree_store::cosign_newest(&audit, NODE, &with_dead, &HttpTransport, &mut known)
        .expect("round");
    assert_eq!((r.size, r.cosigned_by.len()), (300, 1), "{:?}", r.failures);
    assert_eq!(r.failures.len(), 1);
    assert_eq!(r.failures[0].0, dead_url);
    // The tenant fetches its receipt now, before the fork: to the cosigned tree of 300.
    let kept_receipt =
        match tree_store::request_receipt(&digest::LocalStore::new(&audit), NODE, 0, "acme", 5000)
            .expect("receipt")
        {
            tree_store::ReceiptStatus::Ready(json) => json,
            other => panic!("sealed and cosigned: {other:?}"),
        };
    let older_disk = dir.join("older-disk");
    copy_dir(&audit, &older_disk);
    for i in 300..697 {
        w.record(page(i, "acme")).expect("record");
    }
    let removed_promise = answered(&w, 6000);
    w.close().expect("close");
    let r = tree_store::cosign_newest(&audit, NODE, &targets, &HttpTransport, &mut known)
        .expect("round");
    assert_eq!((r.size, r.cosigned_by.len()), (700, 1), "{:?}", r.failures);
    let policy = WitnessPolicy {
        vkeys: vec![wvkey.clone()],
        min: 1,
        checkpoints: Vec::new(),
    };
    let expect = digest::Expect {
        witnesses: Some(policy.clone()),
        ..Default::default()
    };
    let good = digest::verify_reporting(
        &digest::LocalStore::new(&audit),
        Some(&vk),
        None,
        None,
        &expect,
    );
    assert!(good.ok(), "{:?}", good.problems);
    assert!(matches!(
        good.trees.get(&NODE),
        Some(TreeStatus::Checked {
            witnessed_size: Some(700),
            ..
        })
    ));

    // Restarted from the older disk: its newest checkpoint is a smaller tree.
    let mut fresh = std::collections::BTreeMap::new();
    let r = tree_store::cosign_newest(&older_disk, NODE, &targets, &HttpTransport, &mut fresh)
        .expect("round");
    assert!(r.cosigned_by.is_empty());
    assert!(r.failures[0].1.contains("rolled back"), "{:?}", r.failures);
    // It signs another history up to the size the witness cosigned.
    let w = AuditWriter::open(WriterConfig::new(&older_disk, NODE, k.0.clone())).expect("writer");
    for i in 300..700 {
        w.record(page(i, "mallory")).expect("record");
    }
    w.close().expect("close");
    let r = tree_store::cosign_newest(&older_disk, NODE, &targets, &HttpTransport, &mut fresh)
        .expect("round");
    assert_eq!(r.size, 700);
    assert!(r.cosigned_by.is_empty());
    assert!(r.failures[0].1.contains("422"), "{:?}", r.failures);

    let o = crate::cli::custody(&[
        "witness",
        "evidence",
        "--state",
        state.to_str().expect("utf-8"),
        "--log",
        &node_vkey,
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("EVIDENCE smaller-tree") && out.contains("EVIDENCE same-size-other-root"),
        "{out}"
    );
    assert!(!out.contains("NOT signed"), "{out}");
    assert_eq!(out.matches("(signed by the log's key)").count(), 4, "{out}");

    // The witness's own checkpoint, held against the forked disk and the true one.
    let (status, cosigned) = http_get(
        &wp.addr,
        &format!(
            "/{}/checkpoint",
            custody_audit::tlog_witness::origin_id(&origin)
        ),
    );
    assert_eq!(status, 200);
    let cp_file = dir.join("witness.checkpoint");
    std::fs::write(&cp_file, &cosigned).expect("write");
    let verify = |root: &Path| {
        crate::cli::custody(&[
            "audit",
            "verify",
            root.to_str().expect("utf-8"),
            "--public-key",
            pubkey.to_str().expect("utf-8"),
            "--witness",
            &wvkey,
            "--witness-checkpoint",
            cp_file.to_str().expect("utf-8"),
        ])
    };
    let o = verify(&older_disk);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("a forked history"), "{out}");
    let o = verify(&audit);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("cosigned by the witnesses up to 700 records"),
        "{out}"
    );

    // The receipt handed out before the fork still verifies against the cosigned checkpoint,
    // and keeps its promise.
    let checked =
        tree_store::verify_receipt(&kept_receipt, &vk, Some(&policy)).expect("the receipt checks");
    assert_eq!(checked.tree_size, 300);
    tree_store::check_promise(&checked, &kept_promise, &vk).expect("kept");
    // Held to each log: the true one keeps both promises; the forked one keeps the first and
    // shows the records of the second missing (another leaf at each promised seq).
    let in_log = |root: &Path, note: &[u8]| {
        tree_store::check_promise_in_log(&digest::LocalStore::new(root), NODE, note, &vk)
            .expect("check")
            .1
    };
    for note in [&kept_promise, &removed_promise] {
        let f = in_log(&audit, note);
        assert!(f.broken.is_empty() && f.pending.is_empty(), "{f:?}");
    }
    assert!(in_log(&older_disk, &kept_promise).broken.is_empty());
    let forked = in_log(&older_disk, &removed_promise);
    assert_eq!(
        (forked.kept.len(), forked.broken.len()),
        (0, 3),
        "{forked:?}"
    );
    let promise_file = dir.join("removed.promise");
    std::fs::write(&promise_file, &removed_promise).expect("write");
    let check = |root: &Path| {
        crate::cli::custody(&[
            "audit",
            "check-promise",
            root.to_str().expect("utf-8"),
            "--node",
            &NODE.to_string(),
            "--promise",
            promise_file.to_str().expect("utf-8"),
            "--public-key",
            pubkey.to_str().expect("utf-8"),
        ])
    };
    let o = check(&older_disk);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("promise BROKEN") && out.contains("BROKEN: seq 697 (requests)"),
        "{out}"
    );
    let o = check(&audit);
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("promise kept"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

/// The independent Python verifier (`verifier/`, no code shared with the Rust) accepts a
/// receipt the node served. Needs `python3` with `cryptography` (scripts/setup.sh installs it).
pub(crate) fn python_verifier_accepts(
    receipt: &Path,
    node_key: &ed25519_dalek::VerifyingKey,
    witness_vkey: &str,
    node: u32,
    promise: Option<&Path>,
) {
    let vkey = custody_audit::tlog::ed25519_vkey(
        &custody_audit::tree_store::default_origin(node, node_key),
        node_key,
    );
    let verifier = Path::new(env!("CARGO_MANIFEST_DIR")).join("../verifier");
    let o = std::process::Command::new("python3")
        .args(["-m", "custody_verify", "receipt"])
        .arg(receipt)
        .args(["--log-key", &vkey, "--witness-key", witness_vkey])
        .args(promise.iter().flat_map(|p| [Path::new("--promise"), p]))
        .env("PYTHONPATH", &verifier)
        .output()
        .expect("python3");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success()
            && out.starts_with("OK: ")
            && (promise.is_none() || out.contains("promise kept")),
        "the Python verifier: {out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A crash after a seal wrote its tiles but before its digest leaves the tree's edge of a later
/// size on disk (here: the newest partial tiles gone, as a completed tile removes them): the
/// next start rebuilds the edge from the sealed records, goes on, and the log verifies.
#[test]
fn a_start_after_a_crash_between_tiles_and_digest_rebuilds_the_edge() {
    let root = tmp_dir("tlog-crash-edge");
    let k = key();
    build_log(&root, &k);
    let tiles = root.join(format!("_tlog/node={NODE}/tile/0"));
    for e in std::fs::read_dir(&tiles).expect("tiles").flatten() {
        if e.file_name().to_string_lossy().ends_with(".p") {
            std::fs::remove_dir_all(e.path()).expect("rm partial");
        }
    }
    let w =
        AuditWriter::open(WriterConfig::new(&*root, NODE, k.0.clone())).expect("the writer starts");
    w.record(AEvent::Page {
        ts_ns: custody_audit::mono_now_ns(),
        request: 1,
        tenant: "t".into(),
        page: 1,
        generation: 1,
        kind: PageKind::Alloc,
    })
    .expect("record");
    w.close().expect("close");
    let r = digest::verify(&root, Some(&k.0.verifying_key()), None, None);
    assert!(r.ok(), "{:?}", r.problems);
    assert!(matches!(tree_of(&r), TreeStatus::Checked { .. }));
}

/// `custody forensics notify` over the incident reproduction's log (tenant A's pages read by
/// tenant B's response) plus an uninvolved tenant: A gets a notice as the source, B as the
/// recipient, C a statement of non-exposure; each names no other tenant, carries only its own
/// records' receipts and every node's window consistency proof, and checks offline with the
/// notice key and the nodes' key — in Rust and in the independent Python verifier; an altered
/// notice does not.
#[test]
fn incident_notices_tell_each_tenant_its_exposure_and_check_alone() {
    let dir = tmp_dir("tlog-notices");
    let root = dir.join("audit");
    let key = crate::disagg::incident_audit_root(&root);
    // An uninvolved tenant's request on node 2, in a later incarnation of its log.
    let w = AuditWriter::open(WriterConfig::new(&*root, 2, key.clone())).expect("writer");
    for kind in [
        custody_audit::RequestKind::Admitted,
        custody_audit::RequestKind::Finished {
            reason: "stop".into(),
        },
    ] {
        w.record(AEvent::Request {
            ts_ns: custody_audit::mono_now_ns(),
            request: 1,
            tenant: "tenant-c".into(),
            kind,
            prompt_tokens: 4,
            output_tokens: 1,
        })
        .expect("record");
    }
    w.close().expect("seal");
    let pubkey = dir.join("node.pub");
    std::fs::write(&pubkey, digest::hex(key.verifying_key().as_bytes())).expect("pub");
    let notice_key = dir.join("notice.key");
    digest::write_key(&digest::generate_key().expect("key"), &notice_key).expect("key");
    let out = dir.join("notices");
    let s = |p: &Path| p.to_str().expect("utf-8").to_owned();
    let o = crate::cli::custody(&[
        "forensics",
        "notify",
        &s(&root),
        "--public-key",
        &s(&pubkey),
        "--out",
        &s(&out),
        "--key",
        &s(&notice_key),
    ]);
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let vkey = std::fs::read_to_string(out.join("notices.vkey")).expect("vkey");
    let notice = |t: &str| -> serde_json::Value {
        serde_json::from_slice(
            &std::fs::read(out.join(format!("{t}.notice.json"))).expect("notice"),
        )
        .expect("json")
    };
    let (a, b, c) = (notice("tenant-a"), notice("tenant-b"), notice("tenant-c"));
    assert_eq!(
        (
            a["exposed"].as_bool(),
            b["exposed"].as_bool(),
            c["exposed"].as_bool()
        ),
        (Some(true), Some(true), Some(false)),
        "{said}"
    );
    assert!(
        !a["as_source"].as_array().expect("as_source").is_empty(),
        "{a}"
    );
    assert!(
        !b["as_recipient"]
            .as_array()
            .expect("as_recipient")
            .is_empty(),
        "{b}"
    );
    assert!(b["as_recipient"][0]["foreign_slots"].as_u64() > Some(0));
    assert!(b["as_recipient"][0]["receipt"]["records"].is_array(), "{b}");
    assert_eq!(
        c["logs"].as_array().map(Vec::len),
        Some(2),
        "both nodes' windows"
    );
    for (t, n) in [("tenant-a", &a), ("tenant-b", &b), ("tenant-c", &c)] {
        let text = n.to_string();
        for other in ["tenant-a", "tenant-b", "tenant-c"] {
            assert!(
                other == t || !text.contains(other),
                "{t}'s notice names {other}"
            );
        }
    }
    let verify = |t: &str| {
        crate::cli::custody(&[
            "receipt",
            "verify-notice",
            &s(&out.join(format!("{t}.notice.json"))),
            "--notice-key",
            vkey.trim(),
            "--node-key",
            &s(&pubkey),
        ])
    };
    for (t, verdict) in [
        ("tenant-a", "EXPOSED"),
        ("tenant-b", "EXPOSED"),
        ("tenant-c", "not exposed"),
    ] {
        let o = verify(t);
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && text.contains(&format!("tenant {t}: {verdict}")),
            "{t}: {text}"
        );
        python_verifier_checks_notice(&out, t, vkey.trim(), &key.verifying_key());
    }
    // One byte of B's notice changed: its signature no longer covers it.
    let path = out.join("tenant-b.notice.json");
    let bytes = std::fs::read(&path).expect("read");
    let altered =
        String::from_utf8_lossy(&bytes).replacen("\"foreign_slots\": ", "\"foreign_slots\": 1", 1);
    std::fs::write(&path, altered).expect("write");
    let o = verify("tenant-b");
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

/// The Python verifier (`custody-verify notice`) accepts a notice with the notice key and the
/// nodes' log keys (one per node origin).
fn python_verifier_checks_notice(
    out: &Path,
    tenant: &str,
    notice_vkey: &str,
    node_key: &ed25519_dalek::VerifyingKey,
) {
    let verifier = Path::new(env!("CARGO_MANIFEST_DIR")).join("../verifier");
    let mut cmd = std::process::Command::new("python3");
    cmd.args(["-m", "custody_verify", "notice"])
        .arg(out.join(format!("{tenant}.notice.json")))
        .args(["--notice-key", notice_vkey]);
    for node in [1, 2] {
        let origin = custody_audit::tree_store::default_origin(node, node_key);
        cmd.args([
            "--log-key",
            &custody_audit::tlog::ed25519_vkey(&origin, node_key),
        ]);
    }
    let o = cmd.env("PYTHONPATH", &verifier).output().expect("python3");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && text.starts_with("OK: "),
        "the Python verifier on {tenant}'s notice: {text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

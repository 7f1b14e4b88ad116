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

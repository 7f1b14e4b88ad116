//! The `custody` binary as a user runs it (the default-features build `scripts/test.sh` keeps at
//! `target/default-features/custody`): each command does what its help says, and a wrong or
//! missing input is a clear error with a failing exit code.

use std::path::Path;
use std::process::{Command, Output};

use crate::audit::{col_str, read_table, tmp_dir};
use crate::symbols::default_features_binary;

pub(crate) fn custody(args: &[&str]) -> Output {
    Command::new(default_features_binary())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the custody binary (scripts/test.sh builds it)")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn ok(o: Output, what: &str) -> Output {
    assert!(
        o.status.success(),
        "{what}: {:?}\n{}\n{}",
        o.status,
        stdout(&o),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn keygen_generate_verify_and_show_sql_do_what_their_help_says() {
    let dir = tmp_dir("cli");
    let model = custody_tests::model_path();
    let (key, audit) = (dir.join("k.key"), dir.join("audit"));

    // `keygen --out k.key` writes the public key to `<out>.pub`, as its help says.
    let o = ok(custody(&["audit", "keygen", "--out", s(&key)]), "keygen");
    let public = dir.join("k.key.pub");
    assert!(public.exists(), "no {}: {}", public.display(), stdout(&o));
    assert!(stdout(&o).contains(s(&public)));

    // `generate --tenant` records that tenant (colocated, as with --prefill).
    ok(
        custody(&[
            "generate",
            "--model",
            s(&model),
            "--prompt",
            "Hello",
            "--max-tokens",
            "3",
            "--tenant",
            "acme",
            "--audit-dir",
            s(&audit),
            "--audit-key",
            s(&key),
        ]),
        "generate",
    );
    let tenants: Vec<String> = read_table(&audit, "requests")
        .iter()
        .flat_map(|b| col_str(b, "tenant"))
        .map(Option::unwrap_or_default)
        .collect();
    assert!(
        !tenants.is_empty() && tenants.iter().all(|t| t == "acme"),
        "{tenants:?}"
    );

    ok(
        custody(&["audit", "verify", s(&audit), "--public-key", s(&public)]),
        "verify with the signing key's public key",
    );
    // With another key nothing is valid — neither the digests nor the files they name.
    let other = dir.join("other.key");
    ok(custody(&["audit", "keygen", "--out", s(&other)]), "keygen");
    let other_pub = dir.join("other.key.pub");
    let o = custody(&["audit", "verify", s(&audit), "--public-key", s(&other_pub)]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let out = stdout(&o);
    assert!(out.contains("valid digests: 0"), "{out}");
    assert!(out.contains("valid files:   0"), "{out}");

    // What `--show-sql` prints runs as printed with `query -c` (settings, comments, several
    // statements).
    let o = ok(
        custody(&["forensics", "exposure", s(&audit), "--show-sql"]),
        "show-sql",
    );
    let script = stdout(&o);
    assert!(
        script.contains("SET ") && script.contains("-- "),
        "{script}"
    );
    ok(
        custody(&["query", s(&audit), "--format", "csv", "-c", &script]),
        "query -c with the printed script",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Checkpoints on stdout for a log collector (`[audit] checkpoint_stdout`), mixed with the
/// command's own output: `verify --expect-checkpoint <the collected log>` finds the cut tail
/// after the attacker deleted the newest sealing and the root's own checkpoint copy.
#[test]
fn checkpoints_a_log_collector_kept_catch_a_cut_tail() {
    let dir = tmp_dir("cli-collector");
    let model = custody_tests::model_path();
    let (key, audit, collected) = (
        dir.join("k.key"),
        dir.join("audit"),
        dir.join("collected.log"),
    );
    ok(custody(&["audit", "keygen", "--out", s(&key)]), "keygen");
    let config = dir.join("node.toml");
    std::fs::write(
        &config,
        format!(
            "[audit]\ndir = {:?}\nkey = {:?}\nnode = 1\ncheckpoint_stdout = true\n",
            s(&audit),
            s(&key)
        ),
    )
    .expect("config");
    let mut log = String::new();
    for prompt in ["Hello", "Once upon a time"] {
        let o = ok(
            custody(&[
                "generate",
                "--config",
                s(&config),
                "--model",
                s(&model),
                "--prompt",
                prompt,
                "--max-tokens",
                "3",
            ]),
            "generate",
        );
        log.push_str(&stdout(&o));
    }
    assert!(log.contains("custody-checkpoint {"), "{log}");
    std::fs::write(&collected, &log).expect("collected log");
    crate::checkpoint::cut_tail(&audit, true);
    let pubkey = dir.join("k.key.pub");
    let blind = custody(&["audit", "verify", s(&audit), "--public-key", s(&pubkey)]);
    assert!(
        blind.status.success(),
        "without the collector's log: {}",
        stdout(&blind)
    );
    let o = custody(&[
        "audit",
        "verify",
        s(&audit),
        "--public-key",
        s(&pubkey),
        "--expect-checkpoint",
        s(&collected),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(stdout(&o).contains("TAIL CUT on node 1"), "{}", stdout(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `custody certs` makes a fleet's CA once and node certificates naming their identities; it
/// never overwrites a key, and a malformed node is a clear error.
#[test]
fn certs_makes_a_ca_once_and_node_certificates_without_overwriting() {
    let dir = tmp_dir("cli-certs");
    let out = dir.join("fleet");
    let o = ok(
        custody(&[
            "certs",
            "--out",
            s(&out),
            "--node",
            "prefill:1",
            "--node",
            "decode:2",
        ]),
        "certs",
    );
    assert!(
        stdout(&o).contains("custody-node:decode:2"),
        "{}",
        stdout(&o)
    );
    for f in [
        "ca.pem",
        "ca.key",
        "prefill-1.pem",
        "prefill-1.key",
        "decode-2.pem",
        "decode-2.key",
    ] {
        assert!(out.join(f).exists(), "{f}");
    }
    // The same CA signs a later node; an existing node's files are not overwritten.
    let o = ok(
        custody(&["certs", "--out", s(&out), "--node", "front:0"]),
        "certs again",
    );
    assert!(stdout(&o).contains("(existing)"), "{}", stdout(&o));
    let again = custody(&["certs", "--out", s(&out), "--node", "decode:2"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("must not exist yet"));
    let bad = custody(&["certs", "--out", s(&out), "--node", "cook:1"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a node identity"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The GPU check on a machine without a GPU (these): `custody gpu-check` without the `cuda`
/// feature says why it cannot run; `scripts/gpu-check.sh` stops at the missing driver with a
/// clear line and its summary table, exit 1 — cleanly, before any stage runs the binary.
#[test]
fn the_gpu_check_fails_cleanly_without_a_gpu() {
    if Path::new("/dev/nvidia0").exists() {
        custody_tests::skip(
            "e2e::cli::the_gpu_check_fails_cleanly_without_a_gpu",
            "this machine has a GPU (scripts/gpu-check.sh runs there)",
            custody_tests::Need::Optional,
        );
        return;
    }
    let o = custody(&["gpu-check", "device"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot use a GPU") && err.contains("--features cuda"),
        "{err}"
    );

    let out = tmp_dir("gpu-check");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh");
    let o = Command::new("bash")
        .arg(&script)
        .arg(default_features_binary())
        .env("OUT", &*out)
        .output()
        .expect("run gpu-check.sh");
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(
        text.contains("no NVIDIA driver") && text.contains("libcuda.so.1"),
        "{text}"
    );
    let summary = std::fs::read_to_string(out.join("summary.txt")).expect("summary");
    assert!(summary.contains("environment  FAIL"), "{summary}");
    assert!(
        text.trim_end().ends_with(summary.trim_end()),
        "the summary is printed last"
    );
}

//! Audit is on unless refused out loud: `custody serve` without `--audit-dir` records into the
//! default root (`$XDG_STATE_HOME/custody/audit`) with a key made on first use (mode 0600), and
//! that log verifies; `--no-audit` serves degraded and says so (ERROR, `/metrics`,
//! `/health/ready`), and is refused in front of a pair unless the config allows it. And
//! `custody audit verify` without a key says UNAUTHENTICATED (exit 3, or 0 with `--allow-tofu`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::audit::tmp_dir;
use crate::symbols::default_features_binary;

/// The repository's `configs/…`.
fn config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs")
        .join(name)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The binary with HOME and XDG_STATE_HOME inside `state` (nothing written to the user's).
fn custody_in(state: &Path) -> Command {
    let mut c = Command::new(default_features_binary());
    c.env("HOME", state.join("home"))
        .env("XDG_STATE_HOME", state.join("xdg"))
        .env("RUST_LOG", "info");
    c
}

/// A served node's two listeners: the tenants' API and the operator's (`/metrics`).
struct Urls {
    api: String,
    operator: String,
}

/// `custody serve --config configs/serve-demo.toml` on free ports (API and operator listener),
/// stderr into `state/serve.log`.
fn serve(state: &Path, extra: &[&str]) -> (Child, Urls) {
    serve_config(state, &config("serve-demo.toml"), extra)
}

/// [`serve`] with another configuration file.
fn serve_config(state: &Path, cfg: &Path, extra: &[&str]) -> (Child, Urls) {
    let (port, metrics_port) = (free_port(), free_port());
    let log = std::fs::File::create(state.join("serve.log")).expect("log");
    let child = custody_in(state)
        .arg("serve")
        .arg("--config")
        .arg(cfg)
        .arg("--model")
        .arg(custody_tests::model_path())
        .args(["--listen", &format!("127.0.0.1:{port}"), "--threads", "2"])
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn custody serve");
    let urls = Urls {
        api: format!("http://127.0.0.1:{port}"),
        operator: format!("http://127.0.0.1:{metrics_port}"),
    };
    (child, urls)
}

fn get(url: &str, path: &str) -> Option<(u16, String)> {
    let r = custody_server::client::request(url, "GET", path, None, None, Duration::from_secs(5));
    r.ok()
        .map(|r| (r.status, String::from_utf8_lossy(&r.body).into_owned()))
}

/// `/health/ready`'s answer once it is 200 (bounded; the child must stay up).
fn wait_ready(child: &mut Child, url: &str, state: &Path) -> String {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(180) {
        if let Some((200, body)) = get(url, "/health/ready") {
            return body;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("custody serve exited with {st}: {}", log(state));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("custody serve not ready: {}", log(state));
}

fn log(state: &Path) -> String {
    std::fs::read_to_string(state.join("serve.log")).unwrap_or_default()
}

/// SIGTERM, then a clean exit within a bound.
fn terminate(mut child: Child, state: &Path) {
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(st.success());
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        if let Ok(Some(st)) = child.try_wait() {
            assert!(
                st.success(),
                "custody serve exited with {st}: {}",
                log(state)
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("custody serve did not exit after SIGTERM: {}", log(state));
}

fn verify(state: &Path, root: &Path, extra: &[&str]) -> Output {
    custody_in(state)
        .args(["audit", "verify"])
        .arg(root)
        .args(extra)
        .output()
        .expect("custody audit verify")
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn serve_without_audit_dir_records_a_verifiable_log_in_the_default_root() {
    let state = tmp_dir("default-root");
    let (mut child, urls) = serve(&state, &[]);
    let ready = wait_ready(&mut child, &urls.api, &state);
    assert!(ready.contains("\"ok\""), "{ready}");
    let (_, metrics) = get(&urls.operator, "/metrics").expect("metrics");
    assert!(metrics.contains("custody_audit_disabled 0"), "{metrics}");
    terminate(child, &state);

    let custody = state.join("xdg/custody");
    let key = custody.join("node.key");
    let mode = std::fs::metadata(&key)
        .expect("the key made on first use")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "key mode {mode:o}");
    let logged = log(&state);
    assert!(
        logged.contains("audit signing key generated") && logged.contains(&*key.to_string_lossy()),
        "the key's creation is said, with its path: {logged}"
    );
    let root = custody.join("audit");
    let public = custody.join("node.key.pub");
    let pinned = verify(&state, &root, &["--public-key", &public.to_string_lossy()]);
    assert!(pinned.status.success(), "{}", text(&pinned));
    assert!(
        text(&pinned).contains("audit log verified: OK"),
        "{}",
        text(&pinned)
    );

    let tofu = verify(&state, &root, &[]);
    assert_eq!(tofu.status.code(), Some(3), "{}", text(&tofu));
    assert!(text(&tofu).contains("UNAUTHENTICATED"), "{}", text(&tofu));
    let allowed = verify(&state, &root, &["--allow-tofu"]);
    assert!(allowed.status.success(), "{}", text(&allowed));
    assert!(
        text(&allowed).contains("UNAUTHENTICATED"),
        "{}",
        text(&allowed)
    );
    assert!(
        !text(&allowed).contains("verified: OK"),
        "{}",
        text(&allowed)
    );
}

#[test]
fn no_audit_serves_degraded_and_says_so_everywhere() {
    let state = tmp_dir("no-audit");
    let (mut child, urls) = serve(&state, &["--no-audit"]);
    let ready = wait_ready(&mut child, &urls.api, &state);
    assert!(
        ready.contains("\"degraded\"") && ready.contains("audit_disabled"),
        "{ready}"
    );
    let (_, metrics) = get(&urls.operator, "/metrics").expect("metrics");
    assert!(metrics.contains("custody_audit_disabled 1"), "{metrics}");
    terminate(child, &state);
    let logged = log(&state);
    assert!(
        logged.contains("ERROR") && logged.contains("AUDIT IS OFF"),
        "{logged}"
    );
    assert!(
        !state.join("xdg/custody/audit").exists(),
        "nothing recorded with --no-audit"
    );
}

#[test]
fn no_audit_in_front_of_a_pair_needs_the_configs_consent() {
    let state = tmp_dir("no-audit-front");
    let front = |cfg: &Path| {
        custody_in(&state)
            .arg("serve")
            .arg("--config")
            .arg(cfg)
            .args(["--prefill", "http://127.0.0.1:1", "--no-audit"])
            .output()
            .expect("custody serve")
    };
    let refused = front(&config("serve-demo.toml"));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("allow_no_audit"),
        "{err}"
    );
    // With the config's consent the audit question is settled: it fails later, on the
    // certificates this test does not make.
    let consenting = state.join("front.toml");
    let demo = std::fs::read_to_string(config("serve-demo.toml")).expect("demo config");
    std::fs::write(&consenting, demo + "\n[audit]\nallow_no_audit = true\n").expect("config");
    let later = front(&consenting);
    let err = String::from_utf8_lossy(&later.stderr);
    assert!(
        !later.status.success() && !err.contains("allow_no_audit"),
        "{err}"
    );
}

/// A serving node with `[[audit.witnesses]]`: one `custody witness` process, one witness that
/// is down. Its tree checkpoints are cosigned by the live one as it seals (every second here),
/// the dead one's failures are counted in `/metrics` and recorded as `node_events`
/// `tlog_uncosigned` rows, serving goes on, and `audit verify --witness` accepts the log.
#[test]
fn a_serving_node_has_its_checkpoints_cosigned_and_says_when_a_witness_is_down() {
    use custody_audit::digest;
    let state = tmp_dir("serve-witness");
    let node = 5u32;
    let key = digest::generate_key().expect("key");
    let key_file = state.join("node.key");
    digest::write_key(&key, &key_file).expect("write key");
    let wkey = digest::generate_key().expect("witness key");
    let wkey_file = state.join("w1.key");
    digest::write_key(&wkey, &wkey_file).expect("write key");
    let vk = key.verifying_key();
    let node_vkey = custody_audit::tlog::ed25519_vkey(
        &custody_audit::tree_store::default_origin(node, &vk),
        &vk,
    );
    let wp = crate::tlog::start_witness(&wkey_file, "w1.test", &state.join("w1"), &[node_vkey]);
    let w1_vkey = custody_audit::cosign::vkey("w1.test", &wkey.verifying_key());
    let dead = format!("http://127.0.0.1:{}", free_port());
    let root = state.join("audit");
    let mut cfg = std::fs::read_to_string(config("serve-demo.toml")).expect("config");
    cfg.push_str(&format!(
        "\n[audit]\ndir = {root:?}\nkey = {key_file:?}\nnode = {node}\nseal_interval_s = 1\ncheckpoint_interval_s = 1\n\n[[audit.witnesses]]\nurl = \"http://{}\"\nvkey = \"{w1_vkey}\"\n\n[[audit.witnesses]]\nurl = \"{dead}\"\nvkey = \"{w1_vkey}\"\n",
        wp.addr
    ));
    let cfg_file = state.join("node.toml");
    std::fs::write(&cfg_file, cfg).expect("config");
    let (child, urls) = serve_config(&state, &cfg_file, &[]);
    // Killed if the test fails before its clean stop (no stray server on a failure).
    let mut guard = KillOnDrop(Some(child));
    wait_ready(guard.0.as_mut().expect("child"), &urls.api, &state);
    let body = br#"{"model":"smollm2-135m-instruct","prompt":"Hello","max_tokens":4}"#;
    let r = custody_server::client::request(
        &urls.api,
        "POST",
        "/v1/completions",
        Some("sk-demo-acme"),
        Some(body),
        Duration::from_secs(60),
    )
    .expect("completion");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let answer: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    let promised = &answer["custody_receipt"]["requests"][0];
    assert_eq!(
        promised["request_id"].as_str(),
        r.header("x-request-id"),
        "the answer's receipt is its request's: {answer}"
    );
    let promised_tables: Vec<&str> = promised["records"]
        .as_array()
        .unwrap_or_else(|| panic!("the answer promises its records: {answer}"))
        .iter()
        .filter_map(|r| r["table"].as_str())
        .collect();
    assert!(
        promised_tables.contains(&"requests") && promised_tables.contains(&"page_reads"),
        "{promised_tables:?}"
    );
    let answer_file = state.join("answer.json");
    std::fs::write(&answer_file, &r.body).expect("write");
    // Streamed, two choices: each choice's final chunk promises its own request's records.
    let streamed = custody_server::client::request(
        &urls.api,
        "POST",
        "/v1/completions",
        Some("sk-demo-acme"),
        Some(br#"{"model":"smollm2-135m-instruct","prompt":"Hello","max_tokens":3,"n":2,"stream":true}"#),
        Duration::from_secs(60),
    )
    .expect("stream");
    assert_eq!(streamed.status, 200);
    let finals: Vec<serde_json::Value> = String::from_utf8_lossy(&streamed.body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(
        finals.len(),
        2,
        "{}",
        String::from_utf8_lossy(&streamed.body)
    );
    let mut streamed_ids: Vec<&str> = finals
        .iter()
        .map(|c| {
            let e = &c["custody_receipt"]["requests"][0];
            assert!(e["promise"].is_string(), "{c}");
            e["request_id"].as_str().expect("request id")
        })
        .collect();
    streamed_ids.dedup();
    assert_eq!(streamed_ids.len(), 2, "one request per choice: {finals:?}");
    // Sealed within a second or two, then cosigned by w1.
    let cosigned = root.join(format!("_tlog/node={node}/cosigned"));
    let t0 = Instant::now();
    let cosigned_by_w1 = loop {
        if let Ok(note) = std::fs::read(&cosigned)
            && custody_audit::cosign::cosignatures(&note, std::slice::from_ref(&w1_vkey))
                .is_ok_and(|c| !c.is_empty())
        {
            break true;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(cosigned_by_w1, "no cosigned checkpoint: {}", log(&state));
    let (_, metrics) = get(&urls.operator, "/metrics").expect("metrics");
    let uncosigned: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("custody_audit_uncosigned_checkpoints_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no counter: {metrics}"));
    assert!(uncosigned > 0, "the dead witness's rounds are counted");
    // The tenant's receipt for its request: 202 until sealed and checkpointed, then every
    // record of the request with its proof to the cosigned checkpoint.
    let request_id = r.header("x-request-id").expect("x-request-id").to_owned();
    let path = format!("/v1/audit/receipt/{request_id}");
    assert_eq!(r.header("x-custody-receipt"), Some(path.as_str()));
    let fetch = |key: &str| {
        custody_server::client::request(
            &urls.api,
            "GET",
            &path,
            Some(key),
            None,
            Duration::from_secs(30),
        )
        .expect("receipt")
    };
    // Not sealed yet: pending for its tenant, unknown for another (no existence leaks).
    assert_eq!(
        fetch("sk-demo-globex").status,
        404,
        "another tenant's request"
    );
    let t0 = Instant::now();
    let receipt = loop {
        let got = fetch("sk-demo-acme");
        if got.status == 200 {
            let json = got.body;
            let v: serde_json::Value = serde_json::from_slice(&json).expect("json");
            // Wait for the checkpoint the witness cosigned.
            if custody_audit::cosign::cosignatures(
                v["checkpoint"].as_str().expect("checkpoint").as_bytes(),
                std::slice::from_ref(&w1_vkey),
            )
            .is_ok_and(|c| !c.is_empty())
            {
                break json;
            }
        } else {
            assert_eq!(got.status, 202, "{}", String::from_utf8_lossy(&got.body));
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no receipt: {}",
            log(&state)
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert_eq!(
        fetch("sk-demo-globex").status,
        404,
        "another tenant's request"
    );
    let checked = custody_audit::tree_store::verify_receipt(
        &receipt,
        &vk,
        Some(&custody_audit::tree_store::WitnessPolicy {
            vkeys: vec![w1_vkey.clone()],
            min: 1,
            checkpoints: Vec::new(),
        }),
    )
    .expect("the receipt checks");
    let tables: Vec<&str> = checked
        .records
        .iter()
        .map(|(_, r)| r.table.as_str())
        .collect();
    assert!(
        tables.contains(&"requests") && tables.contains(&"page_reads"),
        "{tables:?}"
    );
    let receipt_file = state.join("receipt.json");
    std::fs::write(&receipt_file, &receipt).expect("write");
    let pubkey = state.join("node.pub");
    std::fs::write(&pubkey, digest::hex(vk.as_bytes())).expect("pub");
    let o = custody_in(&state)
        .args(["receipt", "verify"])
        .arg(&receipt_file)
        .arg("--node-key")
        .arg(&pubkey)
        .args(["--witness-key", &w1_vkey])
        .arg("--promise")
        .arg(&answer_file)
        .output()
        .expect("custody receipt verify");
    assert!(
        o.status.success() && text(&o).contains("receipt OK") && text(&o).contains("promise kept"),
        "{}",
        text(&o)
    );
    // A promised record the receipt lacks: the promise is shown broken.
    let mut v: serde_json::Value = serde_json::from_slice(&receipt).expect("json");
    let records = v["records"].as_array_mut().expect("records");
    let dropped = records.remove(records.len() / 2);
    std::fs::write(&receipt_file, serde_json::to_vec(&v).expect("json")).expect("write");
    let o = custody_in(&state)
        .args(["receipt", "verify"])
        .arg(&receipt_file)
        .arg("--node-key")
        .arg(&pubkey)
        .arg("--promise")
        .arg(&answer_file)
        .output()
        .expect("custody receipt verify");
    assert!(
        o.status.code() == Some(1)
            && text(&o).contains(&format!("promised record {} ", dropped["seq"])),
        "{}",
        text(&o)
    );
    // Altered: one byte of one record's bytes.
    let mut v: serde_json::Value = serde_json::from_slice(&receipt).expect("json");
    let proof = v["records"][0]["proof"].as_str().expect("proof").to_owned();
    let flipped = proof.replacen("extra Y3V", "extra Y3W", 1);
    assert_ne!(flipped, proof, "the record bytes start as documented");
    v["records"][0]["proof"] = serde_json::Value::String(flipped);
    std::fs::write(&receipt_file, serde_json::to_vec(&v).expect("json")).expect("write");
    let o = custody_in(&state)
        .args(["receipt", "verify"])
        .arg(&receipt_file)
        .arg("--node-key")
        .arg(&pubkey)
        .output()
        .expect("custody receipt verify");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    std::fs::write(&receipt_file, &receipt).expect("write");
    crate::tlog::python_verifier_accepts(&receipt_file, &vk, &w1_vkey, node, Some(&answer_file));
    let (status, _) = get(&urls.api, "/v1/audit/checkpoint").unwrap_or((0, String::new()));
    assert_eq!(status, 401, "the checkpoint endpoint wants a tenant's key");
    terminate(guard.0.take().expect("child"), &state);
    let events = crate::audit::read_table(&root, "node_events");
    let kinds: Vec<String> = events
        .iter()
        .flat_map(|b| crate::audit::col_str(b, "event"))
        .flatten()
        .collect();
    assert!(kinds.iter().any(|k| k == "tlog_uncosigned"), "{kinds:?}");
    let o = verify(
        &state,
        &root,
        &[
            "--public-key",
            pubkey.to_str().expect("utf-8"),
            "--witness",
            &w1_vkey,
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("cosigned by the witnesses up to"),
        "{}",
        text(&o)
    );
}

/// A child process killed when dropped, unless taken.
struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `[audit] require_cosignatures = 1` with its only witness down: once the node has sealed a
/// tree checkpoint nobody cosigned, it takes no new work (503 `audit_uncosigned`, readiness 503)
/// — fail-closed only where configured.
#[test]
fn a_node_that_requires_cosignatures_fails_closed_without_them() {
    use custody_audit::digest;
    let state = tmp_dir("serve-require-cosign");
    let key = digest::generate_key().expect("key");
    let key_file = state.join("node.key");
    digest::write_key(&key, &key_file).expect("write key");
    let wkey = digest::generate_key().expect("witness key");
    let w_vkey = custody_audit::cosign::vkey("w1.test", &wkey.verifying_key());
    let dead = format!("http://127.0.0.1:{}", free_port());
    let root = state.join("audit");
    let mut cfg = std::fs::read_to_string(config("serve-demo.toml")).expect("config");
    cfg.push_str(&format!(
        "\n[audit]\ndir = {root:?}\nkey = {key_file:?}\nnode = 6\nseal_interval_s = 1\ncheckpoint_interval_s = 1\nrequire_cosignatures = 1\n\n[[audit.witnesses]]\nurl = \"{dead}\"\nvkey = \"{w_vkey}\"\n"
    ));
    let cfg_file = state.join("node.toml");
    std::fs::write(&cfg_file, cfg).expect("config");
    let (child, urls) = serve_config(&state, &cfg_file, &[]);
    let mut guard = KillOnDrop(Some(child));
    // Its start-up records are sealed within a second, nobody cosigns them: it never becomes
    // ready, and says why.
    let t0 = Instant::now();
    let ready = loop {
        if let Some((503, body)) = get(&urls.api, "/health/ready")
            && body.contains("audit_uncosigned")
        {
            break body;
        }
        if let Ok(Some(st)) = guard.0.as_mut().expect("child").try_wait() {
            panic!("custody serve exited with {st}: {}", log(&state));
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "never failed closed: {}",
            log(&state)
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(ready.contains("audit_uncosigned"), "{ready}");
    let body = br#"{"model":"smollm2-135m-instruct","prompt":"Hello","max_tokens":2}"#;
    let r = custody_server::client::request(
        &urls.api,
        "POST",
        "/v1/completions",
        Some("sk-demo-acme"),
        Some(body),
        Duration::from_secs(60),
    )
    .expect("completion");
    assert_eq!(r.status, 503);
    assert!(String::from_utf8_lossy(&r.body).contains("audit_uncosigned"));
    // Killed by the guard: a clean stop is another test's subject.
    drop(guard);
}

/// A pair's process (decode or prefill node) started from the shipped config with its ports
/// moved to `ports` and seals every second; killed on drop.
fn pair_node(
    state: &Path,
    role: &str,
    ports: &[(u16, u16)],
    root: &Path,
    key: &Path,
) -> KillOnDrop {
    pair_node_with(state, role, ports, root, key, "", "")
}

/// [`pair_node`] with `audit_keys` added to its `[audit]` section and `audit_extra` appended to
/// its config (its `[[audit.witnesses]]`).
fn pair_node_with(
    state: &Path,
    role: &str,
    ports: &[(u16, u16)],
    root: &Path,
    key: &Path,
    audit_keys: &str,
    audit_extra: &str,
) -> KillOnDrop {
    let mut text = std::fs::read_to_string(config(&format!("disagg-{role}.toml"))).expect("config");
    for (shipped, free) in ports {
        text = text.replace(
            &format!("127.0.0.1:{shipped}\""),
            &format!("127.0.0.1:{free}\""),
        );
    }
    text = text.replace(
        "[audit]\n",
        &format!("[audit]\nseal_interval_s = 1\ncheckpoint_interval_s = 1\n{audit_keys}"),
    );
    text.push_str(audit_extra);
    let cfg = state.join(format!("{role}.toml"));
    std::fs::write(&cfg, text).expect("config");
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(state.join(format!("{role}.log")))
        .expect("log");
    let child = custody_in(state)
        .current_dir(state)
        .arg(role)
        .arg("--config")
        .arg(&cfg)
        .arg("--model")
        .arg(custody_tests::model_path())
        .args(["--threads", "1", "--audit-dir"])
        .arg(root)
        .arg("--audit-key")
        .arg(key)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn a pair node");
    KillOnDrop(Some(child))
}

/// Plain-HTTP `/health/ready` of a pair node, bounded.
fn wait_node(url: &str, state: &Path, role: &str) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(180) {
        if let Some((200, _)) = get(url, "/health/ready") {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = std::fs::read_to_string(state.join(format!("{role}.log"))).unwrap_or_default();
    panic!("{role} node not ready: {log}");
}

/// In front of a pair (the shipped configs, mutual TLS): an answer carries both nodes' signed
/// promises — decode's of its records, prefill's of its own — and the front serves each node's
/// receipt (forwarded to the node that holds the log, a decode node's through its prefill peer),
/// which keeps its node's promise; another tenant's request is unknown through the front too.
#[test]
fn a_pair_answer_carries_both_nodes_promises_and_the_front_serves_their_receipts() {
    let state = tmp_dir("pair-receipts");
    let pf = PairFiles::new(&state);
    let (key_file, pubkey) = (pf.key_file.clone(), pf.pubkey.clone());
    let root = state.join("audit");
    let (ports, url) = (&pf.ports, |shipped: u16| pf.url(shipped));
    let _decode = pair_node(&state, "decode", ports, &root, &key_file);
    wait_node(&url(7074), &state, "decode");
    let _prefill = pair_node(&state, "prefill", ports, &root, &key_file);
    wait_node(&url(7073), &state, "prefill");
    let (mut front, api) = start_front(&state, &url(7070));
    let r = custody_server::client::request(
        &api,
        "POST",
        "/v1/completions",
        Some("sk-demo-acme"),
        Some(br#"{"model":"smollm2-135m-instruct","prompt":"Hello","max_tokens":4}"#),
        Duration::from_secs(60),
    )
    .expect("completion");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let answer: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    let entries = answer["custody_receipt"]["requests"]
        .as_array()
        .unwrap_or_else(|| panic!("no custody_receipt: {answer}"))
        .clone();
    let nodes: Vec<u64> = entries.iter().filter_map(|e| e["node"].as_u64()).collect();
    assert_eq!(nodes, [2, 1], "decode's promise, then prefill's: {answer}");
    assert_eq!(entries[1]["request_id"].as_str(), r.header("x-request-id"));
    let answer_file = state.join("answer.json");
    std::fs::write(&answer_file, &r.body).expect("write");
    // Ended by the front itself (a stop sequence matched in the text, whole and streamed): the
    // front tells the pair first, then both nodes' promises are in the answer all the same.
    // Greedy, and far more tokens allowed than the stop lets through: decode must still hold
    // the request when the front's end arrives (a request that ended on its own first, at an
    // end-of-text token or its token budget, is recorded as it ended: no "ended by prefill").
    for stream in [false, true] {
        let body = format!(
            r#"{{"model":"smollm2-135m-instruct","prompt":"Hello","max_tokens":2000,"temperature":0,"stop":[" "],"stream":{stream}}}"#
        );
        let r = custody_server::client::request(
            &api,
            "POST",
            "/v1/completions",
            Some("sk-demo-acme"),
            Some(body.as_bytes()),
            Duration::from_secs(60),
        )
        .expect("completion");
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let text = String::from_utf8_lossy(&r.body).into_owned();
        let last = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or(Some(l)))
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .rfind(|v| v.get("custody_receipt").is_some())
            .unwrap_or_else(|| panic!("no custody_receipt: {text}"));
        let nodes: Vec<(u64, bool)> = last["custody_receipt"]["requests"]
            .as_array()
            .expect("requests")
            .iter()
            .map(|e| (e["node"].as_u64().unwrap_or(0), e["promise"].is_string()))
            .collect();
        assert_eq!(nodes, [(2, true), (1, true)], "stream {stream}: {last}");
    }
    let decode_log = std::fs::read_to_string(state.join("decode.log")).unwrap_or_default();
    assert!(
        decode_log.contains("ended by prefill"),
        "the front ended them (a stop sequence), and told the pair: {decode_log}"
    );
    for e in &entries {
        assert!(e["promise"].is_string(), "{e}");
        let fetch = e["fetch"].as_str().expect("fetch path");
        let get_as = |key: &str| {
            custody_server::client::request(
                &api,
                "GET",
                fetch,
                Some(key),
                None,
                Duration::from_secs(30),
            )
            .expect("receipt")
        };
        let t0 = Instant::now();
        let receipt = loop {
            let got = get_as("sk-demo-acme");
            if got.status == 200 {
                break got.body;
            }
            assert_eq!(
                got.status,
                202,
                "{fetch}: {}",
                String::from_utf8_lossy(&got.body)
            );
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{fetch}: never sealed"
            );
            std::thread::sleep(Duration::from_millis(300));
        };
        assert_eq!(
            get_as("sk-demo-globex").status,
            404,
            "another tenant's request"
        );
        let file = state.join("receipt.json");
        std::fs::write(&file, &receipt).expect("write");
        let o = custody_in(&state)
            .args(["receipt", "verify"])
            .arg(&file)
            .arg("--node-key")
            .arg(&pubkey)
            .arg("--promise")
            .arg(&answer_file)
            .output()
            .expect("custody receipt verify");
        assert!(
            o.status.success() && text(&o).contains("promise kept"),
            "{fetch}: {}{}",
            text(&o),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // The decode node's checkpoint, through the front and the prefill node.
    let cp = custody_server::client::request(
        &api,
        "GET",
        "/v1/audit/checkpoint?node=2",
        Some("sk-demo-acme"),
        None,
        Duration::from_secs(30),
    )
    .expect("checkpoint");
    assert_eq!(cp.status, 200, "{}", String::from_utf8_lossy(&cp.body));
    assert!(String::from_utf8_lossy(&cp.body).contains("/node-2/"));
    terminate(front.0.take().expect("front"), &state);
}

/// A completion through `api` as `key`: the response, retried while the pair is re-pairing
/// (503), bounded.
fn complete(api: &str, key: &str, prompt: &str) -> custody_server::client::Response {
    let body = format!(
        r#"{{"model":"smollm2-135m-instruct","prompt":"{prompt}","max_tokens":3,"temperature":0}}"#
    );
    let t0 = Instant::now();
    loop {
        let r = custody_server::client::request(
            api,
            "POST",
            "/v1/completions",
            Some(key),
            Some(body.as_bytes()),
            Duration::from_secs(60),
        );
        match r {
            Ok(r) if r.status == 200 => return r,
            other if t0.elapsed() > Duration::from_secs(120) => {
                panic!("no completion: {:?}", other.map(|r| (r.status, r.body)))
            }
            _ => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

/// The receipt at `fetch` once its checkpoint carries `witness`'s cosignature (bounded).
fn cosigned_receipt(api: &str, fetch: &str, witness: &str) -> Vec<u8> {
    let t0 = Instant::now();
    loop {
        let got = custody_server::client::request(
            api,
            "GET",
            fetch,
            Some("sk-demo-acme"),
            None,
            Duration::from_secs(30),
        )
        .expect("receipt");
        if got.status == 200 {
            let v: serde_json::Value = serde_json::from_slice(&got.body).expect("json");
            let cp = v["checkpoint"].as_str().unwrap_or_default().as_bytes();
            if custody_audit::cosign::cosignatures(cp, &[witness.to_owned()])
                .is_ok_and(|c| !c.is_empty())
            {
                return got.body;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "{fetch}: no cosigned receipt"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The size of the tree a root's newest checkpoint note names (0: none yet).
fn tree_size(root: &Path, node: u32) -> u64 {
    std::fs::read(root.join(format!("_tlog/node={node}/checkpoint")))
        .ok()
        .and_then(|n| custody_audit::tlog::note_checkpoint(&n).ok())
        .map_or(0, |c| c.size())
}

fn signal(child: &KillOnDrop, sig: &str) {
    let pid = child.0.as_ref().expect("child").id().to_string();
    let st = Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("kill");
    assert!(st.success());
}

/// The issue's fleet-shaped split view, with the real processes: a pair behind its front, each
/// node cosigned by a `custody witness`. The decode node is restarted from a copy of its disk
/// taken earlier and, with its own key, signs another history past the size the witness
/// cosigned. The witness refuses it and keeps both checkpoints as evidence; `audit verify` with
/// the witness's checkpoint reports the fork; the receipt a tenant fetched before the fork
/// still verifies against the cosigned checkpoint and keeps its answer's promise; the promise
/// of a request the fork removed is shown broken against the forked log.
#[test]
fn a_decode_node_restarted_from_an_older_disk_is_caught_by_its_witness_and_its_promises() {
    use custody_audit::digest;
    let state = tmp_dir("pair-fork");
    let pf = PairFiles::new(&state);
    let (key_file, pubkey) = (pf.key_file.clone(), pf.pubkey.clone());
    let vk = pf.key.verifying_key();
    let wkey = digest::generate_key().expect("witness key");
    let wkey_file = state.join("w1.key");
    digest::write_key(&wkey, &wkey_file).expect("write key");
    let w1 = custody_audit::cosign::vkey("w1.test", &wkey.verifying_key());
    let log_vkey = |node| {
        custody_audit::tlog::ed25519_vkey(
            &custody_audit::tree_store::default_origin(node, &vk),
            &vk,
        )
    };
    let wstate = state.join("w1");
    let wp =
        crate::tlog::start_witness(&wkey_file, "w1.test", &wstate, &[log_vkey(1), log_vkey(2)]);
    let witnesses = format!(
        "\n[[audit.witnesses]]\nurl = \"http://{}\"\nvkey = \"{w1}\"\n",
        wp.addr
    );
    let (decode_root, prefill_root) = (state.join("audit-decode"), state.join("audit-prefill"));
    let (ports, url) = (&pf.ports, |shipped: u16| pf.url(shipped));
    let start_decode = || {
        let d = pair_node_with(
            &state,
            "decode",
            ports,
            &decode_root,
            &key_file,
            "",
            &witnesses,
        );
        wait_node(&url(7074), &state, "decode");
        d
    };
    let mut decode = start_decode();
    let _prefill = pair_node_with(
        &state,
        "prefill",
        ports,
        &prefill_root,
        &key_file,
        "",
        &witnesses,
    );
    wait_node(&url(7073), &state, "prefill");
    let (mut front, api) = start_front(&state, &url(7070));

    // Before the fork: an answer, and its decode node's receipt to a cosigned checkpoint.
    let decode_entry = |r: &custody_server::client::Response| -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        v["custody_receipt"]["requests"][0].clone()
    };
    let first = complete(&api, "sk-demo-acme", "Hello");
    let kept_answer = state.join("kept-answer.json");
    std::fs::write(&kept_answer, &first.body).expect("write");
    let e = decode_entry(&first);
    assert_eq!(e["node"].as_u64(), Some(2), "{e}");
    let kept_receipt = cosigned_receipt(&api, e["fetch"].as_str().expect("fetch"), &w1);
    // The older disk: the decode node's root as it stands now (the process paused meanwhile).
    signal(&decode, "-STOP");
    let older = state.join("older-decode");
    crate::audit::copy_dir(&decode_root, &older);
    signal(&decode, "-CONT");
    // A request the fork will remove, cosigned too.
    let second = complete(&api, "sk-demo-acme", "Goodbye");
    let removed_answer = state.join("removed-answer.json");
    std::fs::write(&removed_answer, &second.body).expect("write");
    let e = decode_entry(&second);
    cosigned_receipt(&api, e["fetch"].as_str().expect("fetch"), &w1);
    let cosigned_size = tree_size(&decode_root, 2);

    // The decode node restarted from the older disk signs another history past that size.
    drop(decode);
    std::fs::remove_dir_all(&decode_root).expect("rm");
    crate::audit::copy_dir(&older, &decode_root);
    decode = start_decode();
    let evidence = || {
        custody_in(&state)
            .args(["witness", "evidence", "--state"])
            .arg(&wstate)
            .args(["--log", &log_vkey(2)])
            .output()
            .expect("custody witness evidence")
    };
    let t0 = Instant::now();
    let mut n = 0;
    while tree_size(&decode_root, 2) <= cosigned_size || evidence().status.code() != Some(1) {
        n += 1;
        complete(&api, "sk-demo-globex", &format!("Another {n}"));
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "no fork evidence: tree {} (cosigned {cosigned_size})",
            tree_size(&decode_root, 2)
        );
    }
    let o = evidence();
    let out = text(&o);
    assert!(
        out.contains("EVIDENCE") && !out.contains("NOT signed"),
        "{out}"
    );
    // The witness's own checkpoint, held against the forked disk.
    let origin_id =
        custody_audit::tlog_witness::origin_id(&custody_audit::tree_store::default_origin(2, &vk));
    let (status, cosigned) = get(
        &format!("http://{}", wp.addr),
        &format!("/{origin_id}/checkpoint"),
    )
    .expect("the witness's checkpoint");
    assert_eq!(status, 200);
    let cp_file = state.join("w1.checkpoint");
    std::fs::write(&cp_file, cosigned).expect("write");
    // Held to the live nodes through the front: the answer before the fork keeps both nodes'
    // promises; the removed request's decode promise is broken (the forked tree holds other
    // leaves at its seqs), though the node serves no receipt of it any more.
    let live_check = |answer: &Path| {
        custody_in(&state)
            .env("CUSTODY_API_KEY", "sk-demo-acme")
            .args(["receipt", "check-promise"])
            .arg(answer)
            .args(["--url", &api])
            .arg("--node-key")
            .arg(&pubkey)
            .output()
            .expect("custody receipt check-promise")
    };
    let o = live_check(&kept_answer);
    assert!(
        o.status.success() && text(&o).contains("promises kept"),
        "{}{}",
        text(&o),
        String::from_utf8_lossy(&o.stderr)
    );
    let o = live_check(&removed_answer);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}{}",
        text(&o),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(text(&o).contains("BROKEN: req-2-"), "{}", text(&o));
    terminate(front.0.take().expect("front"), &state);
    drop(decode);
    let o = verify(
        &state,
        &decode_root,
        &[
            "--public-key",
            pubkey.to_str().expect("utf-8"),
            "--witness",
            &w1,
            "--witness-checkpoint",
            cp_file.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("a forked history"), "{}", text(&o));
    // The receipt fetched before the fork still holds, with its answer's promise.
    let receipt_file = state.join("kept-receipt.json");
    std::fs::write(&receipt_file, &kept_receipt).expect("write");
    let o = custody_in(&state)
        .args(["receipt", "verify"])
        .arg(&receipt_file)
        .arg("--node-key")
        .arg(&pubkey)
        .args(["--witness-key", &w1])
        .arg("--promise")
        .arg(&kept_answer)
        .output()
        .expect("custody receipt verify");
    assert!(
        o.status.success() && text(&o).contains("promise kept"),
        "{}",
        text(&o)
    );
    // The removed request's promise, held to the forked log: broken.
    let o = custody_in(&state)
        .args(["audit", "check-promise"])
        .arg(&decode_root)
        .args(["--node", "2", "--promise"])
        .arg(&removed_answer)
        .arg("--public-key")
        .arg(&pubkey)
        .output()
        .expect("custody audit check-promise");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("promise BROKEN"), "{}", text(&o));
}

/// `[audit] require_cosignatures = 1` on a pair's decode node whose only witness is down: once
/// it has sealed a checkpoint nobody cosigned, its readiness is 503 `audit_uncosigned` and it
/// reserves nothing, so a request through the prefill node is refused before anything is
/// admitted or transferred — fail-closed on a pair too.
#[test]
fn a_pair_node_that_requires_cosignatures_fails_closed_without_them() {
    use custody_audit::digest;
    let state = tmp_dir("pair-require-cosign");
    let pf = PairFiles::new(&state);
    let key_file = pf.key_file.clone();
    let w_vkey = custody_audit::cosign::vkey(
        "w1.test",
        &digest::generate_key().expect("key").verifying_key(),
    );
    let dead = format!(
        "\n[[audit.witnesses]]\nurl = \"http://127.0.0.1:{}\"\nvkey = \"{w_vkey}\"\n",
        free_port()
    );
    let root = state.join("audit");
    let (ports, url) = (&pf.ports, |shipped: u16| pf.url(shipped));
    let _decode = pair_node_with(
        &state,
        "decode",
        ports,
        &root,
        &key_file,
        "require_cosignatures = 1\n",
        &dead,
    );
    let t0 = Instant::now();
    loop {
        if let Some((503, body)) = get(&url(7074), "/health/ready")
            && body.contains("audit_uncosigned")
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "the decode node never failed closed: {}",
            std::fs::read_to_string(state.join("decode.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let _prefill = pair_node(&state, "prefill", ports, &root, &key_file);
    wait_node(&url(7073), &state, "prefill");
    let o = custody_in(&state)
        .current_dir(&*state)
        .args(["generate", "--config"])
        .arg(config("serve-demo.toml"))
        .args([
            "--prefill",
            &url(7070),
            "--prompt",
            "Hi",
            "--max-tokens",
            "2",
        ])
        .arg("--model")
        .arg(custody_tests::model_path())
        .output()
        .expect("custody generate --prefill");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("audit_uncosigned"),
        "{err}"
    );
}

/// A pair's files in a test's state directory: its certificates (`custody certs`, where the
/// shipped configs' relative `certs/…` paths find them), one signing key for both nodes, and a
/// free port for each of the shipped configs' (7070–7074).
struct PairFiles {
    key: custody_audit::digest::SigningKey,
    key_file: PathBuf,
    pubkey: PathBuf,
    ports: Vec<(u16, u16)>,
}

impl PairFiles {
    fn new(state: &Path) -> Self {
        use custody_audit::digest;
        let o = custody_in(state)
            .current_dir(state)
            .args(["certs", "--out", "certs"])
            .args([
                "--node",
                "prefill:1",
                "--node",
                "decode:2",
                "--node",
                "front:0",
            ])
            .output()
            .expect("custody certs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let key = digest::generate_key().expect("key");
        let key_file = state.join("node.key");
        digest::write_key(&key, &key_file).expect("write key");
        let pubkey = state.join("node.pub");
        std::fs::write(&pubkey, digest::hex(key.verifying_key().as_bytes())).expect("pub");
        Self {
            key,
            key_file,
            pubkey,
            ports: (7070..=7074).map(|p| (p, free_port())).collect(),
        }
    }

    /// The URL of the port the shipped configs name `shipped`.
    fn url(&self, shipped: u16) -> String {
        let p = self
            .ports
            .iter()
            .find(|(s, _)| *s == shipped)
            .expect("port")
            .1;
        format!("http://127.0.0.1:{p}")
    }
}

/// `custody serve` in front of the prefill node at `prefill` (serve-demo.toml's tenants and
/// certificate), ready; its API URL.
fn start_front(state: &Path, prefill: &str) -> (KillOnDrop, String) {
    let (port, metrics_port) = (free_port(), free_port());
    let front = custody_in(state)
        .current_dir(state)
        .arg("serve")
        .arg("--config")
        .arg(config("serve-demo.toml"))
        .args(["--prefill", prefill])
        .arg("--model")
        .arg(custody_tests::model_path())
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(state.join("serve.log")).expect("log"))
        .spawn()
        .expect("spawn the front");
    let mut front = KillOnDrop(Some(front));
    let api = format!("http://127.0.0.1:{port}");
    wait_ready(front.0.as_mut().expect("front"), &api, state);
    (front, api)
}

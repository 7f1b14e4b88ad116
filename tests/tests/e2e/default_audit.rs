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
    let (port, metrics_port) = (free_port(), free_port());
    let log = std::fs::File::create(state.join("serve.log")).expect("log");
    let child = custody_in(state)
        .arg("serve")
        .arg("--config")
        .arg(config("serve-demo.toml"))
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

//! Every shipped configuration (`configs/*.toml`) starts the way its header or the README says
//! — the real `custody` binary, the file's own engine, pool, batching, TLS and fleet values —
//! and comes up: `/health/ready` answers 200 on every node (a router: once a pair is routable),
//! `single-node.toml` generates a token, `witness.toml` is the witness's valid configuration.
//!
//! Changed, only because one machine runs every deployment at once: each address becomes a free
//! loopback port (the same one wherever a deployment's files name it), the fleet's prefix-cache
//! secret file a temporary one, and the audit log goes to a temporary root (`--audit-dir`, as the
//! README's commands pass it). The certificates are made by `custody certs` in the directory the
//! processes run in, so the files' relative `certs/…` paths are used as shipped. Deployments
//! start concurrently; a new file in `configs/` without a deployment here fails the test.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::audit::{TmpDir, tmp_dir};
use crate::symbols::default_features_binary;

/// How long a deployment may take to come up (five processes loading the model and calibrating
/// on a two-core machine among the others).
const BOUND: Duration = Duration::from_secs(240);

/// The fleet's shipped prefix-cache secret path, replaced by a temporary file.
const SHIPPED_SECRET: &str = "/etc/custody/prefix-cache.secret";

/// One process of a deployment: its config file, its subcommand and extra arguments.
struct NodeSpec {
    file: &'static str,
    args: &'static [&'static str],
}

const fn node(file: &'static str, args: &'static [&'static str]) -> NodeSpec {
    NodeSpec { file, args }
}

/// A deployment: stages of processes; every process of a stage must be ready before the next
/// stage starts (decode nodes before the prefill nodes that pair with them, as the README says).
struct Deployment {
    name: &'static str,
    stages: &'static [&'static [NodeSpec]],
}

const DEPLOYMENTS: &[Deployment] = &[
    Deployment {
        name: "single",
        stages: &[&[node(
            "single-node.toml",
            &["generate", "--prompt", "Hi", "--max-tokens", "1"],
        )]],
    },
    Deployment {
        name: "demo",
        stages: &[&[node("serve-demo.toml", &["serve"])]],
    },
    Deployment {
        name: "pair",
        stages: &[
            &[node("disagg-decode.toml", &["decode"])],
            &[node("disagg-prefill.toml", &["prefill"])],
        ],
    },
    Deployment {
        name: "incident",
        stages: &[
            &[node("incident.toml", &["decode", "--unsafe-reproduction"])],
            &[node(
                "incident-prefill.toml",
                &["prefill", "--unsafe-reproduction"],
            )],
        ],
    },
    Deployment {
        name: "fleet",
        stages: &[
            &[
                node("fleet-decode-3.toml", &["decode", "--node", "3"]),
                node("fleet-decode-4.toml", &["decode", "--node", "4"]),
            ],
            &[
                node("fleet-prefill-1.toml", &["prefill", "--node", "1"]),
                node("fleet-prefill-2.toml", &["prefill", "--node", "2"]),
            ],
            &[node("fleet-router.toml", &["serve", "--node", "9"])],
        ],
    },
];

/// Configuration files that are not a node's: checked by what reads them.
const OTHER_FILES: &[&str] = &["witness.toml"];

fn configs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

/// A free loopback port (bound, then released for the process to bind).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `host:port` with a numeric IPv4 host.
fn is_addr(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    host.parse::<std::net::Ipv4Addr>().is_ok() && port.parse::<u16>().is_ok()
}

/// `text` with every quoted address (`"h:p"`, `"http://h:p"`) replaced by its loopback port in
/// `ports` (a new one the first time a deployment names it) and the shipped secret path by
/// `secret`. Everything else — every budget, context and switch — stays as shipped.
fn localise(text: &str, ports: &mut BTreeMap<String, u16>, secret: &Path) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, part) in text.split('"').enumerate() {
        if i > 0 {
            out.push('"');
        }
        // Odd parts are inside quotes.
        let (scheme, rest) = part
            .strip_prefix("http://")
            .map_or(("", part), |r| ("http://", r));
        if i % 2 == 1 && is_addr(rest) {
            let port = *ports.entry(rest.to_owned()).or_insert_with(free_port);
            out.push_str(&format!("{scheme}127.0.0.1:{port}"));
        } else if i % 2 == 1 && part == SHIPPED_SECRET {
            out.push_str(&secret.display().to_string());
        } else {
            out.push_str(part);
        }
    }
    out
}

/// The quoted value of `key = "…"` in `text` (the first such line).
fn value(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let rest = l.trim_start().strip_prefix(key)?.trim_start();
        let rest = rest.strip_prefix('=')?.trim_start().strip_prefix('"')?;
        Some(rest[..rest.find('"')?].to_owned())
    })
}

/// A started process, killed when dropped.
struct Proc {
    child: Child,
    name: String,
    log: PathBuf,
    /// Where it says it is ready (`/health/ready` on this address); `None`: it runs to its end.
    ready: Option<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Best effort: the process may have exited already.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn tail(&self) -> String {
        let t = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = t.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// Start `d` in `dir`; `Ok` once every process is ready (or, one that runs to its end, exited
/// with success).
fn bring_up(d: &Deployment, dir: &Path, key: &Path, secret: &Path) -> Result<(), String> {
    let bin = default_features_binary();
    let mut ports = BTreeMap::new();
    let root = dir.join(format!("audit-{}", d.name));
    let mut procs: Vec<Proc> = Vec::new();
    let t0 = Instant::now();
    for stage in d.stages {
        let first = procs.len();
        for n in *stage {
            let shipped = std::fs::read_to_string(configs_dir().join(n.file))
                .map_err(|e| format!("{}: {e}", n.file))?;
            let text = localise(&shipped, &mut ports, secret);
            let cfg = dir.join(format!("{}-{}", d.name, n.file));
            std::fs::write(&cfg, &text).map_err(|e| e.to_string())?;
            let serve = n.args[0] == "serve";
            let ready = if serve {
                value(&text, "listen")
            } else {
                value(&text, "health_listen")
            };
            if ready.is_none() && n.args[0] != "generate" {
                return Err(format!("{}: no health address to wait for", n.file));
            }
            let log = dir.join(format!("{}-{}.log", d.name, n.file));
            let logf = std::fs::File::create(&log).map_err(|e| e.to_string())?;
            let mut cmd = Command::new(&bin);
            cmd.current_dir(dir)
                .args(&n.args[..1])
                .arg("--config")
                .arg(&cfg)
                .args(&n.args[1..]);
            if n.args[0] != "generate" {
                cmd.arg("--audit-dir")
                    .arg(&root)
                    .arg("--audit-key")
                    .arg(key);
            }
            if serve {
                // The operator's listener: a free port too (the shipped one where it is named).
                let m = value(&text, "metrics_listen")
                    .unwrap_or_else(|| format!("127.0.0.1:{}", free_port()));
                cmd.arg("--metrics-listen").arg(m);
            }
            let child = cmd
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(logf)
                .spawn()
                .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
            procs.push(Proc {
                child,
                name: n.file.to_owned(),
                log,
                ready: ready.map(|a| format!("http://{a}")),
            });
        }
        for p in &mut procs[first..] {
            loop {
                if let Some(url) = &p.ready {
                    let r = custody_server::client::request(
                        url,
                        "GET",
                        "/health/ready",
                        None,
                        None,
                        Duration::from_secs(2),
                    );
                    if r.as_ref().is_ok_and(|r| r.status == 200) {
                        break;
                    }
                }
                match p.child.try_wait() {
                    Ok(Some(s)) if p.ready.is_none() && s.success() => break,
                    Ok(Some(s)) => {
                        return Err(format!("{} exited ({s}):\n{}", p.name, p.tail()));
                    }
                    Ok(None) => {}
                    Err(e) => return Err(format!("{}: {e}", p.name)),
                }
                if t0.elapsed() > BOUND {
                    return Err(format!(
                        "{} not ready within {BOUND:?}:\n{}",
                        p.name,
                        p.tail()
                    ));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    eprintln!("{}: up in {:?}", d.name, t0.elapsed());
    Ok(())
}

#[test]
fn every_shipped_config_starts() {
    // Every file is someone's: a deployment here, or one of the other files.
    let mut files: Vec<String> = std::fs::read_dir(configs_dir())
        .expect("configs/")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".toml"))
        .collect();
    files.sort();
    let covered: Vec<&str> = DEPLOYMENTS
        .iter()
        .flat_map(|d| d.stages.iter().flat_map(|s| s.iter().map(|n| n.file)))
        .chain(OTHER_FILES.iter().copied())
        .collect();
    for f in &files {
        assert!(
            covered.contains(&f.as_str()),
            "configs/{f} is started by no deployment of this test"
        );
    }

    // The witness's attach points: the configuration `custody probe --config` reads.
    let w = std::fs::read_to_string(configs_dir().join("witness.toml")).expect("witness.toml");
    let w = custody_ebpf::WitnessConfig::from_toml(&w).expect("configs/witness.toml");
    assert!(!w.attach.is_empty());

    let dir: TmpDir = tmp_dir("configs");
    let out = Command::new(default_features_binary())
        .current_dir(&*dir)
        .args(["certs", "--out", "certs"])
        .args([
            "--node",
            "prefill:1",
            "--node",
            "prefill:2",
            "--node",
            "decode:2",
            "--node",
            "decode:3",
            "--node",
            "decode:4",
            "--node",
            "front:0",
            "--node",
            "front:9",
        ])
        .output()
        .expect("run custody certs (scripts/test.sh builds target/default-features/custody)");
    assert!(
        out.status.success(),
        "custody certs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = dir.join("audit.key");
    custody_audit::digest::write_key(&custody_audit::digest::generate_key().expect("key"), &key)
        .expect("audit key");
    let secret = dir.join("prefix-cache.secret");
    std::fs::write(&secret, format!("{}\n", "5a".repeat(32))).expect("secret");

    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = DEPLOYMENTS
            .iter()
            .map(|d| {
                let (dir, key, secret) = (&*dir, &key, &secret);
                (d.name, s.spawn(move || bring_up(d, dir, key, secret)))
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|(name, h)| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("deployment {name}: {e}")),
                Err(_) => Some(format!("deployment {name}: panicked")),
            })
            .collect()
    });
    assert!(
        failures.is_empty(),
        "shipped configs that do not come up:\n{}",
        failures.join("\n\n")
    );
}

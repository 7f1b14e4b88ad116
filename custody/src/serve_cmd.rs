//! `custody serve` (the OpenAI-compatible server), `custody serve hash-key`, and
//! `custody validate`.

use std::io::BufRead;
use std::sync::Arc;

use crate::config::Config;
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use custody_audit::writer::AuditWriter;
use custody_server::tenants::{generate_key, hash_key};
use custody_server::{AuditStats, ServeOptions};

use crate::audit_open::{AuditArgs, Serving, open_serving_audit};
use crate::common::{Common, Loaded, load};

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct ServeArgs {
    #[command(subcommand)]
    action: Option<ServeAction>,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    audit: AuditArgs,
    /// Listen address (host:port); default: the config's `[serve] listen`.
    #[arg(long)]
    listen: Option<String>,
    /// The operator's listener for `/metrics` (every tenant's counts: never the tenants' port)
    /// and health (host:port, "" = off); default: the config's `[serve] metrics_listen`, else
    /// 127.0.0.1:9464.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Front a disaggregated pair: the prefill node's front door (`http://host:port`);
    /// default: the config's `[serve] prefill`, else a colocated engine in this process.
    /// The model is still loaded here, for the tokenizer and the canary's colocated reference.
    #[arg(long)]
    prefill: Option<String>,
    /// Arm the config's `[unsafe_reproduction]` switches; `serve` honours
    /// `shared_prefix_cache` (one prefix-cache namespace for every tenant: the leak prefix
    /// caches are known for, reproduced on purpose). Logged at ERROR and recorded in the audit
    /// log's `node_events`.
    #[arg(long)]
    unsafe_reproduction: bool,
    /// Serve WITHOUT an audit log (the default records into the default root): logged at
    /// ERROR, `custody_audit_disabled 1` in /metrics, `degraded` in /health/ready. Refused in
    /// front of a pair or as a fleet's router unless the config has `[audit] allow_no_audit = true`.
    #[arg(long, conflicts_with_all = ["audit_dir", "audit_key"])]
    no_audit: bool,
}

#[derive(Subcommand, Debug)]
enum ServeAction {
    /// Print the SHA-256 of an API key, for `keys_sha256` in `[[serve.tenants]]`.
    ///
    /// The key is read from the first line of stdin (so that it stays out of shell history),
    /// or made up with `--generate` (printed once, with its hash: give the key to the tenant,
    /// put the hash in the config).
    HashKey {
        /// Generate a new random key (`sk-custody-` + 128 random bits in hex).
        #[arg(long)]
        generate: bool,
    },
}

#[derive(Args, Debug)]
pub(crate) struct ValidateArgs {
    #[command(flatten)]
    common: Common,
    /// The server to validate; default: http://<the config's [serve] listen>.
    #[arg(long, conflicts_with = "prefill")]
    url: Option<String>,
    /// Validate a disaggregated pair directly through its prefill node's gRPC front door
    /// (`http://host:port`) instead of an HTTP server (no API key needed; tenant `_validate`).
    #[arg(long)]
    prefill: Option<String>,
    /// API key of a tenant (or the environment variable CUSTODY_API_KEY). The validation
    /// requests run as that tenant and are audited as such.
    #[arg(
        long,
        env = "CUSTODY_API_KEY",
        hide_env_values = true,
        required_unless_present = "prefill"
    )]
    api_key: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// The audit writer's queue, for `/metrics` and the 503 high-water check.
#[derive(Debug)]
struct WriterStats(
    Arc<AuditWriter>,
    Option<Arc<crate::cosign_client::CosignStats>>,
);

impl AuditStats for WriterStats {
    fn queue_depth(&self) -> u64 {
        self.0.queue_depth()
    }
    fn queue_capacity(&self) -> u64 {
        self.0.queue_capacity() as u64
    }
    fn dropped_total(&self) -> u64 {
        self.0.dropped_total()
    }
    fn uncosigned_rounds(&self) -> u64 {
        self.1.as_ref().map_or(0, |s| {
            s.uncosigned_rounds
                .load(std::sync::atomic::Ordering::Relaxed)
        })
    }
    fn cosignatures_missing(&self) -> bool {
        self.1
            .as_ref()
            .is_some_and(|s| s.below_required.load(std::sync::atomic::Ordering::Relaxed))
    }
}

pub(crate) fn serve(a: ServeArgs) -> Result<()> {
    if let Some(ServeAction::HashKey { generate }) = a.action {
        return hash_key_cmd(generate);
    }
    let Some(cfg_path) = a.common.config.clone() else {
        bail!(
            "custody serve needs --config: the tenants and their API keys live there (see configs/single-node.toml, [serve])"
        );
    };
    let cfg = Config::load(&cfg_path)?;
    let mut serve_cfg = cfg.serve.clone();
    if let Some(l) = &a.listen {
        serve_cfg.listen = l.clone();
    }
    if let Some(l) = &a.metrics_listen {
        serve_cfg.metrics_listen = l.clone();
    }
    serve_cfg.validate()?;
    if let Some(p) = &a.prefill {
        serve_cfg.prefill = p.clone();
    }
    if cfg.fleet.is_router() && a.prefill.is_none() {
        return serve_router(&a, serve_cfg, &cfg);
    }
    if !serve_cfg.prefill.is_empty() {
        return serve_front(&a, serve_cfg, &cfg);
    }
    let unsafe_ = cfg.unsafe_switches(a.unsafe_reproduction);
    let others: Vec<&str> = unsafe_
        .names()
        .into_iter()
        .filter(|n| *n != "shared_prefix_cache" && *n != "token_only_offload")
        .collect();
    if !others.is_empty() {
        bail!(
            "custody serve honours only [unsafe_reproduction] shared_prefix_cache and token_only_offload; {} apply to the disaggregated nodes (custody prefill|decode)",
            others.join(", ")
        );
    }
    let Loaded {
        mut engine,
        tokenizer,
        pool,
    } = load(&a.common, None)?;
    let node = if a.audit.node != 0 {
        a.audit.node
    } else {
        cfg.audit.node
    };
    let node_audit = open_serving_audit(&a.audit, a.no_audit, &cfg.audit, Serving::Colocated)?;
    let cosign = node_audit.as_ref().and_then(|n| n.cosign.clone());
    let proofs = match &node_audit {
        Some(n) => Some(Arc::new(crate::node_proofs::RootProofs {
            root: n.root.clone(),
            node: n.node,
            // Everything before this is an earlier incarnation's (request ids restart).
            from_seq: n.writer.sync().context("the audit log at start")?,
            writer: n.writer.clone(),
        }) as Arc<dyn custody_server::receipts::AuditProofs>),
        None => None,
    };
    let audit = node_audit.map(|n| n.writer);
    if let Some(w) = &audit {
        engine = engine.with_audit(w.clone());
        let fingerprint = engine.model().gguf().sha256_hex();
        custody_runtime::disagg::node::record_start(&mut engine, "serve", &fingerprint, &unsafe_);
    }
    let prepared = custody_server::prepare(engine, pool, tokenizer, &serve_cfg)?;
    let opts = ServeOptions {
        metrics: None,
        cfg: serve_cfg.clone(),
        node,
        audit: audit
            .clone()
            .map(|w| Arc::new(WriterStats(w, cosign)) as Arc<dyn AuditStats>),
        events: None,
        prefix_cache: cfg.prefix_cache.clone(),
        unsafe_shared_prefix_cache: unsafe_.shared_prefix_cache,
        kv_offload: crate::common::offload_setup(&cfg, node, unsafe_.token_only_offload)?,
        audit_disabled: audit.is_none(),
        proofs,
    };
    let rt = http_runtime()?;
    let engine = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&serve_cfg.listen)
            .await
            .with_context(|| format!("binding {}", serve_cfg.listen))?;
        custody_server::serve(listener, prepared, opts, shutdown_signal())
            .await
            .map_err(anyhow::Error::from)
    })?;
    drop(engine);
    if let Some(w) = audit {
        crate::audit_open::stop_and_seal(&w)?;
        tracing::info!("audit log sealed");
    }
    Ok(())
}

/// A front's or a router's own log: `--audit-dir` (which needs its own `--node`), else the
/// default root; none only with `--no-audit`, which its config must allow. Of the config's
/// `[audit]` only `allow_no_audit` applies: the rest belongs to the engine nodes.
fn own_audit(a: &ServeArgs, cfg: &Config, role: &'static str) -> Result<Option<Arc<AuditWriter>>> {
    if a.audit.audit_dir.is_some() && a.audit.node == 0 {
        bail!(
            "as {role}, --audit-dir needs this server's own --node id (not a prefill's or decode's)"
        );
    }
    let conf = custody_audit::config::AuditSection {
        allow_no_audit: cfg.audit.allow_no_audit,
        ..Default::default()
    };
    let opened = open_serving_audit(&a.audit, a.no_audit, &conf, Serving::Fleet(role))?;
    Ok(opened.map(|n| n.writer))
}

/// The serving options of a server that runs no engine (a pair's front, a router): its own log
/// for its own events.
fn front_options(
    serve_cfg: &custody_server::config::ServeSection,
    node: u32,
    audit: Option<&Arc<custody_audit::writer::AuditWriter>>,
) -> ServeOptions {
    ServeOptions {
        metrics: None,
        cfg: serve_cfg.clone(),
        node,
        audit: audit.map(|w| Arc::new(WriterStats(w.clone(), None)) as Arc<dyn AuditStats>),
        events: audit.map(|w| w.clone() as Arc<dyn custody_audit::AuditSink>),
        prefix_cache: Default::default(),
        unsafe_shared_prefix_cache: false,
        kv_offload: None,
        audit_disabled: audit.is_none(),
        // A front's own log holds no tenant's records: receipts come from the pair's nodes.
        proofs: None,
    }
}

fn http_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// `custody serve` in front of a prefill/decode pair: the pair's nodes run the engines and
/// keep the audit logs of every page; this process authenticates, limits, streams and
/// validates. It keeps its own log of what only it sees — canary results and prefill anomalies
/// (`node_events`) — in `--audit-dir` (with `--audit-key` and its own `--node`) or the default root.
fn serve_front(
    a: &ServeArgs,
    serve_cfg: custody_server::config::ServeSection,
    cfg: &Config,
) -> Result<()> {
    let audit = own_audit(a, cfg, "pair's front")?;
    // The only role a prefill node takes a tenant from: this server's front certificate.
    let security = crate::common::fleet_security(&cfg.tls)?;
    let Loaded {
        engine,
        tokenizer,
        pool,
    } = load(&a.common, None)?;
    let prepared = custody_server::prepare_front(engine, pool, tokenizer, &serve_cfg)?;
    let opts = front_options(&serve_cfg, 0, audit.as_ref());
    let rt = http_runtime()?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&serve_cfg.listen)
            .await
            .with_context(|| format!("binding {}", serve_cfg.listen))?;
        custody_server::serve_prefill(
            listener,
            prepared,
            &serve_cfg.prefill,
            &security,
            opts,
            shutdown_signal(),
        )
        .await
        .map_err(anyhow::Error::from)
    });
    if let Some(w) = audit {
        crate::audit_open::stop_and_seal(&w)?;
        tracing::info!("audit log sealed");
    }
    served
}

/// `custody serve` as the router of a fleet (`[fleet]`): N prefill × M decode nodes, each
/// request routed to a pair (`custody_server::fleet`). The router is a node of its own: it keeps
/// a signed log of every routing decision, retry and health transition (in `--audit-dir`, with
/// `--audit-key` and its own `--node`, or the default root).
fn serve_router(
    a: &ServeArgs,
    serve_cfg: custody_server::config::ServeSection,
    cfg: &Config,
) -> Result<()> {
    let audit = own_audit(a, cfg, "fleet's router")?;
    let security = crate::common::fleet_security(&cfg.tls)?;
    let Loaded {
        engine,
        tokenizer,
        pool,
    } = load(&a.common, None)?;
    let fingerprint = engine.model().gguf().sha256_hex();
    // The fleet's prefix-cache secret, when configured: the router computes a request's chain
    // keys within the request's own namespace (never another tenant's) to route by affinity.
    let namespaces = if cfg.prefix_cache.secret_file.is_some() {
        let n = custody_runtime::prefix_cache::Namespaces::from_section(
            &cfg.prefix_cache,
            &tokenizer,
            false,
        )
        .context("[prefix_cache] for the router's cache affinity")?;
        Some(Arc::new(n))
    } else {
        None
    };
    if let Some(w) = &audit {
        let ev = custody_audit::Event::Node {
            ts_ns: custody_audit::mono_now_ns(),
            kind: "start".into(),
            detail: format!(
                "role=router model_sha256={fingerprint} prefill={} decode={} cache_affinity={}",
                cfg.fleet.prefill.len(),
                cfg.fleet.decode.len(),
                namespaces.is_some()
            ),
        };
        custody_audit::AuditSink::record(&**w, ev).context("recording the router's start")?;
    }
    let prepared = custody_server::prepare_front(engine, pool, tokenizer, &serve_cfg)?;
    let parts = custody_server::fleet::RouterParts {
        node: a.audit.node,
        audit: audit
            .clone()
            .map(|w| w as Arc<dyn custody_audit::AuditSink>),
        namespaces,
        fingerprint,
        // Set by `serve_fleet` from the router's own engine.
        context_length: 0,
    };
    let opts = front_options(&serve_cfg, a.audit.node, audit.as_ref());
    let rt = http_runtime()?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&serve_cfg.listen)
            .await
            .with_context(|| format!("binding {}", serve_cfg.listen))?;
        custody_server::serve_fleet(
            listener,
            prepared,
            cfg.fleet.clone(),
            &security,
            parts,
            opts,
            shutdown_signal(),
        )
        .await
        .map_err(anyhow::Error::from)
    });
    drop(rt);
    if let Some(w) = audit {
        crate::audit_open::stop_and_seal(&w)?;
        tracing::info!("audit log sealed");
    }
    served
}

/// The golden prompts through a pair's front door (gRPC), each compared with its reference.
fn validate_pair(
    prefill: &str,
    tls: &custody_runtime::disagg::config::TlsSection,
    golden: &[custody_server::Golden],
    stop_ids: &[u32],
) -> Result<custody_server::canary::Report> {
    use custody_runtime::disagg::client::collect;
    use custody_runtime::disagg::proto::prefill_client::PrefillClient;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let channel = crate::common::fleet_security(tls)?
            .channel(prefill, custody_runtime::disagg::tls::Role::Prefill)
            .await
            .with_context(|| format!("connecting to the prefill node {prefill}"))?;
        let mut client = PrefillClient::new(channel);
        let mut report = custody_server::canary::Report {
            checked: 0,
            mismatches: Vec::new(),
        };
        for g in golden {
            let got = collect(&mut client, &g.request("_validate", stop_ids))
                .await
                .map(|r| r.tokens)
                .map_err(|s| s.message().to_owned());
            report.add(g, got);
        }
        Ok(report)
    })
}

/// SIGINT or SIGTERM, as a future. The handlers are registered here, when it is called (inside
/// the runtime, before serving starts), not when the future is first polled: a signal that
/// arrives after the first answered request but before that poll would otherwise take the
/// default action and kill the process mid-serve.
pub(crate) fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    if let Err(e) = &term {
        tracing::warn!(error = %e, "SIGTERM handler not installed");
    }
    if let Err(e) = &int {
        tracing::warn!(error = %e, "SIGINT handler not installed");
    }
    async move {
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = wait(term.ok()) => {}
            _ = wait(int.ok()) => {}
        }
        tracing::info!("signal received");
    }
}

fn hash_key_cmd(generate: bool) -> Result<()> {
    if generate {
        let key = generate_key().context("reading /dev/urandom")?;
        println!("key:        {key}");
        println!("key_sha256: {}", hash_key(&key));
        return Ok(());
    }
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .context("reading the key from stdin")?;
    let key = line.trim_end_matches(['\n', '\r']);
    if key.is_empty() {
        bail!("no key on stdin (or pass --generate)");
    }
    println!("{}", hash_key(key));
    Ok(())
}

pub(crate) fn validate(a: ValidateArgs) -> Result<()> {
    let cfg = match &a.common.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    let url = a
        .url
        .clone()
        .unwrap_or_else(|| format!("http://{}", cfg.serve.listen));
    let Loaded {
        mut engine,
        tokenizer,
        pool,
    } = load(&a.common, None)?;
    // The reference: a colocated engine in this process, each golden prompt alone, greedy.
    let golden = custody_server::canary::reference(&mut engine, &pool, &tokenizer, "_validate")
        .map_err(anyhow::Error::msg)?;
    let report = match &a.prefill {
        Some(p) => validate_pair(p, &cfg.tls, &golden, &tokenizer.stop_ids)?,
        None => {
            let key = a.api_key.as_deref().unwrap_or_default();
            custody_server::client::validate(&url, key, &golden)
                .with_context(|| format!("validating {url}"))?
        }
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for g in &golden {
            let m = report.mismatches.iter().find(|m| m.name == g.name);
            match m {
                None => println!("PASS  {:<10} {} tokens identical", g.name, g.expected.len()),
                Some(m) => match (&m.error, m.first_divergence) {
                    (Some(e), _) => println!("FAIL  {:<10} request failed: {e}", g.name),
                    (None, Some(i)) => println!(
                        "FAIL  {:<10} first differing token at position {i}: expected {:?}, got {:?}",
                        g.name,
                        m.expected.get(i),
                        m.got.get(i)
                    ),
                    (None, None) => println!("FAIL  {:<10}", g.name),
                },
            }
        }
    }
    if report.pass() {
        println!(
            "validation passed: {} golden prompts, output identical to the colocated reference token for token",
            report.checked
        );
        Ok(())
    } else {
        println!(
            "validation FAILED: {} of {} golden prompts differ from the colocated reference",
            report.mismatches.len(),
            report.checked
        );
        std::process::exit(1);
    }
}

//! Custody's OpenAI-compatible HTTP server (`custody serve`).
//!
//! - [`prepare`]: start-up work on the engine before it serves (prefill calibration for the
//!   anomaly check, the golden-prompt reference for the canary).
//! - [`serve`]: axum on a listener until the shutdown future fires, then a bounded drain;
//!   returns the engine so the caller can seal the audit log.
//! - The engine runs on its own thread ([`engine_thread`]); handlers reach it over bounded
//!   channels only, and never touch the page pool.
//!
//! Architecture invariant: this crate is the only one that links axum; the runtime stays free
//! of HTTP, and the audit writer (Arrow, Parquet) stays out of this crate — the binary hands in
//! what `/metrics` needs through [`AuditStats`].

pub mod backend;
pub mod canary;
pub mod client;
pub mod config;
pub mod engine_thread;
pub mod error;
pub mod fleet;
mod http;
pub mod metrics;
pub mod openai;
pub mod receipts;
pub mod structured;
pub mod tenants;
pub mod tlog_witness;
pub mod tools;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::config::ServeSection;
use custody_runtime::engine::{Engine, GenerateRequest};
use custody_runtime::grammar::Grammars;
use custody_runtime::prefix_cache::Namespaces;
use custody_runtime::{SamplingParams, Tokenizer};

pub use backend::Backend;
pub use canary::Golden;
pub use engine_thread::{ClientEnd, EndSlot, EngineGauges, EngineHandle, Events, PrefillCheck};
pub use metrics::{AuditStats, Metrics};

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid serve configuration: {0}")]
    Config(String),
    #[error("start-up check failed: {0}")]
    Startup(String),
    #[error("start-up golden reference: {0}")]
    Golden(#[from] canary::GoldenError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("the engine thread panicked")]
    EnginePanicked,
}

/// An engine that has done its start-up work and is ready to serve.
#[derive(Debug)]
pub struct Prepared {
    engine: Engine,
    pool: custody_runtime::par::ThreadPool,
    tokenizer: Arc<Tokenizer>,
    golden: Vec<Golden>,
    check: PrefillCheck,
    gauges: Arc<EngineGauges>,
}

impl Prepared {
    /// The golden prompts and their reference outputs.
    pub fn golden(&self) -> &[Golden] {
        &self.golden
    }
}

/// Tenant of the start-up calibration request (recorded in the audit log like any other).
pub const CALIBRATION_TENANT: &str = "_calibration";

/// Start-up work, blocking: calibrate prefill throughput (the yardstick of the prefill-anomaly
/// check) and compute the golden prompts' reference outputs, each on the idle engine.
pub fn prepare(
    mut engine: Engine,
    pool: custody_runtime::par::ThreadPool,
    tokenizer: Tokenizer,
    cfg: &ServeSection,
) -> Result<Prepared, ServeError> {
    cfg.validate()
        .map_err(|e| ServeError::Config(e.to_string()))?;
    if cfg.tenants.is_empty() {
        return Err(ServeError::Config(
            "no [[serve.tenants]]: nobody could call this server (add one with a key hash from `custody serve hash-key`)"
                .into(),
        ));
    }
    let gauges = Arc::new(EngineGauges::default());
    let (check, tok_s) = calibrate(&mut engine, &pool, &tokenizer, cfg)?;
    gauges
        .calibrated_prefill_tok_s
        .store(tok_s as u64, Ordering::Relaxed);
    let golden = canary::reference(&mut engine, &pool, &tokenizer, canary::CANARY_TENANT)?;
    tracing::info!(
        calibrated_prefill_tok_s = tok_s as u64,
        golden_prompts = golden.len(),
        "start-up checks done"
    );
    Ok(Prepared {
        engine,
        pool,
        tokenizer: Arc::new(tokenizer),
        golden,
        check,
        gauges,
    })
}

/// Measure prefill throughput on the idle engine: a prompt of up to 256 tokens, alone. The
/// prefill-anomaly check's yardstick is that rate × `prefill_anomaly_factor`. Calibrating on a
/// busy machine only lowers the rate, which makes the check stricter; the factor (8 by default)
/// leaves room for a quieter machine later.
fn calibrate(
    engine: &mut Engine,
    pool: &custody_runtime::par::ThreadPool,
    tokenizer: &Tokenizer,
    cfg: &ServeSection,
) -> Result<(PrefillCheck, f64), ServeError> {
    let n = 256.min(engine.context_length().saturating_sub(2)).max(1);
    let text = "The history of the printing press begins in the fifteenth century. ".repeat(32);
    let mut ids = tokenizer
        .encode(&text, false)
        .map_err(|e| ServeError::Startup(e.to_string()))?;
    ids.truncate(n);
    let req = GenerateRequest {
        decoding: Default::default(),
        prompt: ids.clone(),
        max_tokens: 1,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        tenant: CALIBRATION_TENANT.into(),
        cache: None,
    };
    let (_, ttft) = engine_thread::run_alone(engine, pool, req)
        .map_err(|e| ServeError::Startup(format!("calibration request: {e}")))?;
    let tok_s = ids.len() as f64 / ttft.as_secs_f64().max(1e-9);
    let check = PrefillCheck {
        max_plausible_tok_s: tok_s * cfg.prefill_anomaly_factor,
        min_tokens: cfg.prefill_anomaly_min_tokens,
    };
    Ok((check, tok_s))
}

/// What `serve` needs besides the prepared engine.
#[derive(Debug)]
pub struct ServeOptions {
    /// The operator's listener (`/metrics`, health), already bound; `None`: bind
    /// `cfg.metrics_listen` (empty: no operator listener).
    pub metrics: Option<tokio::net::TcpListener>,
    pub cfg: ServeSection,
    /// Node id (in request ids, as in the audit log).
    pub node: u32,
    /// The audit writer's queue figures, when auditing.
    pub audit: Option<Arc<dyn AuditStats>>,
    /// In front of a pair (`serve_prefill`): this server's own audit log, for its canary results
    /// and prefill anomalies (`node_events`). Colocated, events go through the engine's sink.
    pub events: Option<Arc<dyn custody_audit::AuditSink>>,
    /// `[prefix_cache]`: the namespace secret and the operator's public scopes (used when the
    /// engine caches prefixes).
    pub prefix_cache: custody_runtime::config::PrefixCacheSection,
    /// `[unsafe_reproduction] shared_prefix_cache`, armed: every request in one cache namespace.
    pub unsafe_shared_prefix_cache: bool,
    /// `[kv_offload]`, resolved: the prefix cache's evicted pages go to these tiers.
    pub kv_offload: Option<custody_runtime::offload::OffloadSetup>,
    /// Started without an audit log (`--no-audit`): `/metrics` says `custody_audit_disabled 1`
    /// and `/health/ready` answers `degraded` (still 200: it serves).
    pub audit_disabled: bool,
    /// The node's Merkle-tree proofs and receipts (`/v1/audit/...`), when it keeps a log.
    pub proofs: Option<Arc<dyn receipts::AuditProofs>>,
}

/// The namespaces of the engine's prefix cache, when it has one; each public scope (and the
/// unsafe switch, when armed) recorded in its audit log and logged.
fn prefix_scopes(
    engine: &mut Engine,
    tokenizer: &Tokenizer,
    opts: &ServeOptions,
) -> Result<Option<Arc<Namespaces>>, ServeError> {
    if !engine.prefix_cache_enabled() {
        if opts.unsafe_shared_prefix_cache {
            return Err(ServeError::Config(
                "[unsafe_reproduction] shared_prefix_cache needs engine.prefix_cache = true".into(),
            ));
        }
        if opts.kv_offload.is_some() {
            return Err(ServeError::Config(
                "[kv_offload] needs engine.prefix_cache = true (only cached pages are offloaded)"
                    .into(),
            ));
        }
        return Ok(None);
    }
    let scopes = Namespaces::from_section(
        &opts.prefix_cache,
        tokenizer,
        opts.unsafe_shared_prefix_cache,
    )
    .map_err(|e| ServeError::Config(e.to_string()))?;
    for line in scopes.describe() {
        tracing::info!(%line, "prefix cache scope");
        engine.record(custody_audit::Event::Node {
            ts_ns: custody_audit::mono_now_ns(),
            kind: "prefix_scope".into(),
            detail: line,
        });
    }
    if opts.unsafe_shared_prefix_cache {
        tracing::error!(
            "UNSAFE REPRODUCTION: the prefix cache's key has NO TENANT: a prompt one tenant sent is another's cache hit"
        );
    }
    if let Some(setup) = &opts.kv_offload {
        setup
            .enable(engine, &scopes)
            .map_err(|e| ServeError::Config(e.to_string()))?;
    }
    Ok(Some(Arc::new(scopes)))
}

/// Serve on `listener` until `shutdown` resolves; then refuse new work, let in-flight requests
/// finish for up to `drain_timeout_s` (after which they are aborted), stop the engine thread
/// and return the engine. The caller seals the audit log.
pub async fn serve(
    listener: tokio::net::TcpListener,
    prepared: Prepared,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Engine, ServeError> {
    let Prepared {
        engine,
        pool,
        tokenizer,
        golden,
        check,
        gauges,
    } = prepared;
    let model_name = if opts.cfg.model_name.is_empty() {
        engine.model().config.name.clone()
    } else {
        opts.cfg.model_name.clone()
    };
    let context_length = engine.context_length();
    let mut engine = engine;
    let prefix = prefix_scopes(&mut engine, &tokenizer, &opts)?;
    let (handle, join) =
        engine_thread::spawn(engine, pool, opts.cfg.queue_capacity, check, gauges)?;
    let front = Front {
        backend: Backend::Local(handle.clone()),
        tokenizer,
        golden,
        model_name,
        context_length,
        node: opts.node,
        prefix,
    };
    let served = serve_front(listener, front, opts, shutdown).await;
    handle.shutdown().await;
    drop(handle);
    let engine = tokio::task::spawn_blocking(move || join.join())
        .await
        .map_err(|_| ServeError::EnginePanicked)?
        .map_err(|_| ServeError::EnginePanicked)?
        .engine;
    tracing::info!("engine stopped; every request ended");
    served.map(|()| engine)
}

/// The golden prompts' reference for a server that fronts a disaggregated pair: computed on a
/// colocated engine in this process (each prompt alone, greedy), then the engine is dropped.
/// The canary then checks the pair's output against it token for token.
#[derive(Debug)]
pub struct PreparedFront {
    tokenizer: Arc<Tokenizer>,
    golden: Vec<Golden>,
    model_name: String,
    check: PrefillCheck,
    gauges: Arc<EngineGauges>,
    /// The reference engine's context: a router requires every node to state it.
    context_length: usize,
}

pub fn prepare_front(
    mut reference: Engine,
    pool: custody_runtime::par::ThreadPool,
    tokenizer: Tokenizer,
    cfg: &ServeSection,
) -> Result<PreparedFront, ServeError> {
    cfg.validate()
        .map_err(|e| ServeError::Config(e.to_string()))?;
    if cfg.tenants.is_empty() {
        return Err(ServeError::Config(
            "no [[serve.tenants]]: nobody could call this server".into(),
        ));
    }
    // The prefill node's rate is not measured here: this machine's, with the factor's room, is
    // the yardstick (a first token far sooner than either could compute the prompt is flagged).
    let (check, tok_s) = calibrate(&mut reference, &pool, &tokenizer, cfg)?;
    let gauges = Arc::new(EngineGauges::default());
    gauges
        .calibrated_prefill_tok_s
        .store(tok_s as u64, Ordering::Relaxed);
    let golden = canary::reference(&mut reference, &pool, &tokenizer, "_reference")?;
    let model_name = if cfg.model_name.is_empty() {
        reference.model().config.name.clone()
    } else {
        cfg.model_name.clone()
    };
    Ok(PreparedFront {
        context_length: reference.context_length(),
        tokenizer: Arc::new(tokenizer),
        golden,
        model_name,
        check,
        gauges,
    })
}

/// Serve on `listener` in front of a prefill node (`prefill_url`, its gRPC front door): every
/// generation goes to the pair; tenants, limits, errors, metrics and the canary are this
/// server's. Request ids name the prefill node's audit `request_id`. `security`: this server's
/// front certificate (the prefill node admits only fronts it accepts, and takes the tenant from
/// them alone), or plaintext on loopback.
pub async fn serve_prefill(
    listener: tokio::net::TcpListener,
    prepared: PreparedFront,
    prefill_url: &str,
    security: &custody_runtime::disagg::tls::Security,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    use custody_runtime::disagg::proto::{InfoRequest, prefill_client::PrefillClient};
    use custody_runtime::disagg::tls::Role;
    let channel = security
        .channel(prefill_url, Role::Prefill)
        .await
        .map_err(|e| {
            ServeError::Startup(format!("connecting to the prefill node {prefill_url}: {e}"))
        })?;
    let mut client = PrefillClient::new(channel);
    let info = client
        .info(InfoRequest {})
        .await
        .map_err(|e| ServeError::Startup(format!("prefill node {prefill_url}: {e}")))?
        .into_inner();
    tracing::info!(
        prefill = prefill_url,
        node = info.node_id,
        context_length = info.context_length,
        "fronting a prefill/decode pair"
    );
    // Tenants' receipts and proofs: the pair's nodes', through the prefill node.
    let mut opts = opts;
    if opts.proofs.is_none() {
        let remote = receipts::RemoteProofs::new(vec![(info.node_id, client.clone())]);
        opts.proofs = Some(Arc::new(remote));
    }
    let front = Front {
        backend: Backend::Prefill {
            client,
            node: info.node_id,
            gauges: prepared.gauges,
            check: prepared.check,
            audit: opts.events.clone(),
        },
        tokenizer: prepared.tokenizer,
        golden: prepared.golden,
        model_name: prepared.model_name,
        // In front of a pair: prefill-only requests are not cached (their pages are transferred).
        prefix: None,
        context_length: info.context_length as usize,
        node: info.node_id,
    };
    serve_front(listener, front, opts, shutdown).await
}

/// Serve on `listener` as the router of a fleet (`[fleet]`): every generation goes to a
/// prefill/decode pair the router chooses (`fleet.rs`); tenants, limits, errors, metrics and the
/// canary are this server's. `security`: this router's front certificate (every node admits it
/// for its load report; the prefill nodes take the tenant from it alone).
pub async fn serve_fleet(
    listener: tokio::net::TcpListener,
    prepared: PreparedFront,
    fleet: config::FleetSection,
    security: &custody_runtime::disagg::tls::Security,
    parts: fleet::RouterParts,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let node = parts.node;
    // The router's own context (its `[engine]`): every node must state the same, so the HTTP
    // side's length checks hold before any node has reported.
    let context_length = prepared.context_length;
    let parts = fleet::RouterParts {
        context_length: context_length as u64,
        ..parts
    };
    let router = fleet::Router::start(
        fleet,
        security,
        parts,
        prepared.gauges.clone(),
        prepared.check,
    )
    .map_err(|e| ServeError::Startup(e.to_string()))?;
    // Requests before a pair is routable are refused (503), and `/health/ready` says so.
    tracing::info!(context_length, "routing a fleet");
    // Tenants' receipts and proofs: the fleet's nodes', through its prefill nodes.
    let mut opts = opts;
    if opts.proofs.is_none() {
        let remote = receipts::RemoteProofs::new(router.prefill_clients());
        opts.proofs = Some(Arc::new(remote));
    }
    let front = Front {
        backend: Backend::Fleet(router),
        tokenizer: prepared.tokenizer,
        golden: prepared.golden,
        model_name: prepared.model_name,
        // The prefill nodes cache; the router only routes by what they may hold.
        prefix: None,
        context_length,
        node,
    };
    serve_front(listener, front, opts, shutdown).await
}

/// The constraint compiler over the vocabulary (its token trie, built once), or why there is
/// none: then a constrained request is refused by name, and everything else is served.
fn grammars(tokenizer: &Arc<Tokenizer>) -> Result<Arc<Grammars>, String> {
    let t0 = std::time::Instant::now();
    let g = Grammars::for_tokenizer(tokenizer.clone()).map_err(|e| e.to_string())?;
    tracing::debug!(
        ms = t0.elapsed().as_millis() as u64,
        "constraint compiler ready"
    );
    Ok(Arc::new(g))
}

/// What the HTTP front needs, whatever runs the generations.
struct Front {
    /// The prefix cache's namespaces (`None`: the engine caches nothing).
    prefix: Option<Arc<Namespaces>>,
    backend: Backend,
    tokenizer: Arc<Tokenizer>,
    golden: Vec<Golden>,
    model_name: String,
    context_length: usize,
    node: u32,
}

async fn serve_front(
    listener: tokio::net::TcpListener,
    front: Front,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let operator = match opts.metrics {
        Some(l) => Some(l),
        None if opts.cfg.metrics_listen.is_empty() => None,
        None => Some(
            tokio::net::TcpListener::bind(&opts.cfg.metrics_listen)
                .await
                .map_err(|e| {
                    ServeError::Startup(format!(
                        "binding [serve] metrics_listen {}: {e}",
                        opts.cfg.metrics_listen
                    ))
                })?,
        ),
    };
    let Front {
        backend,
        tokenizer,
        golden,
        model_name,
        context_length,
        node,
        prefix,
    } = front;
    let grammars = grammars(&tokenizer);
    let metrics = Arc::new(Metrics::new());
    metrics
        .audit_disabled
        .store(opts.audit_disabled, Ordering::Relaxed);
    let st = Arc::new(http::AppState {
        backend: backend.clone(),
        tokenizer: tokenizer.clone(),
        tenants: tenants::Tenants::new(&opts.cfg.tenants),
        metrics: metrics.clone(),
        cfg: opts.cfg.clone(),
        model_name,
        context_length,
        node,
        audit: opts.audit.clone(),
        draining: AtomicBool::new(false),
        created_unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        refused_seq: AtomicU64::new(0),
        prefix,
        grammars,
        proofs: opts.proofs.clone(),
    });
    let canary = (opts.cfg.canary_interval_s > 0 && !golden.is_empty()).then(|| {
        tokio::spawn(canary::canary_loop(
            backend.clone(),
            Arc::new(golden),
            tokenizer.stop_ids.clone(),
            metrics.clone(),
            Duration::from_secs(opts.cfg.canary_interval_s),
        ))
    });
    let addr = listener.local_addr()?;
    tracing::info!(%addr, model = %st.model_name, tenants = opts.cfg.tenants.len(), "serving");
    let (sig_tx, sig_rx) = tokio::sync::oneshot::channel::<()>();
    let app = http::router(st.clone());
    // The operator's endpoints on their own listener: never on the tenants' port.
    let operator = match operator {
        Some(l) => {
            let addr = l.local_addr()?;
            if !addr.ip().is_loopback() {
                tracing::warn!(%addr, "/metrics (every tenant's traffic) is served beyond loopback: keep this address from tenants");
            }
            tracing::info!(%addr, "operator endpoints (/metrics, /health)");
            let app = http::operator_router(st.clone());
            Some(tokio::spawn(async move { axum::serve(l, app).await }))
        }
        None => {
            tracing::info!("no operator listener ([serve] metrics_listen empty): /metrics is off");
            None
        }
    };
    let mut server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = sig_rx.await;
            })
            .await
    });
    shutdown.await;
    // Refuse new work first, then stop accepting connections and wait for the open ones.
    st.draining.store(true, Ordering::Relaxed);
    if let Some(c) = &canary {
        c.abort();
    }
    let gauges = backend.gauges();
    tracing::info!(
        drain_timeout_s = opts.cfg.drain_timeout_s,
        running = gauges.running.load(Ordering::Relaxed),
        waiting = gauges.waiting.load(Ordering::Relaxed),
        in_flight = st.metrics.in_flight.load(Ordering::Relaxed),
        "shutting down: draining in-flight requests"
    );
    let _ = sig_tx.send(());
    let drain = Duration::from_secs(opts.cfg.drain_timeout_s);
    let served = match tokio::time::timeout(drain, &mut server).await {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!("drain timeout: aborting the requests still in flight");
            if let Backend::Local(h) = &backend {
                h.abort_all("the server is shutting down (drain timeout)")
                    .await;
            }
            // Aborted streams end at once; bounded anyway.
            match tokio::time::timeout(Duration::from_secs(5), &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    server.abort();
                    Ok(Ok(()))
                }
            }
        }
    };
    match served {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "HTTP server error"),
        Err(e) if e.is_cancelled() => {}
        Err(e) => tracing::error!(error = %e, "HTTP server task failed"),
    }
    if let Some(o) = operator {
        // Stopped with the server: a scrape in flight is cut (its next one finds the port shut).
        o.abort();
    }
    if let Some(c) = canary {
        let _ = c.await;
    }
    Ok(())
}

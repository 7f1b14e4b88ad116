//! `custody prefill`, `custody decode` and `custody generate --prefill`: the disaggregated roles.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use custody_audit::{AuditSink, Event as AuditEvent};
use custody_runtime::config::UnsafeReproduction;
use custody_runtime::disagg::Drain;
use custody_runtime::disagg::checkpoints::PeerCheckpoints;
use custody_runtime::disagg::client::{serve_decode, serve_prefill};
use custody_runtime::disagg::decode::{DecodeHandle, DecodeOptions};
use custody_runtime::disagg::fleet::FleetNode;
use custody_runtime::disagg::prefill::DecodeTarget;
use custody_runtime::disagg::prefill::{PrefillHandle, PrefillOptions};
use custody_runtime::disagg::proto::prefill_client::PrefillClient;
use custody_runtime::disagg::tls::{NodeIdentity, Role as FleetRole, Security};
use custody_runtime::prefix_cache::Namespaces;
use custody_runtime::tokenizer::StreamDecoder;
use custody_runtime::{Engine, Model, SamplingParams, Tokenizer};

use crate::config::Config;

use crate::common::{AuditArgs, Common, fleet_security, open_node_audit};
use crate::generate_cmd::GenerateArgs;

#[derive(Args, Debug)]
pub(crate) struct RoleArgs {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    audit: AuditArgs,
    /// Arm the config's `[unsafe_reproduction]` switches (the incident's faults, on purpose).
    /// Without this flag they are ignored; with it they are logged at ERROR and recorded in the
    /// audit log's `node_events`.
    #[arg(long)]
    unsafe_reproduction: bool,
    /// Reservation lease (decode): a reservation not committed within this many ms is aborted —
    /// its transport key invalidated first, then its pages freed.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
}

struct Role {
    cfg: Config,
    engine: Engine,
    unsafe_: UnsafeReproduction,
    fingerprint: String,
    node: u32,
    audit: Option<Arc<custody_audit::writer::AuditWriter>>,
    checkpoints: Option<PeerCheckpoints>,
    security: Security,
}

fn load_role(a: &RoleArgs, role: &str) -> Result<Role> {
    let Some(path) = &a.common.config else {
        bail!("custody {role} needs --config (see configs/disagg-{role}.toml)");
    };
    let cfg = Config::load(path)?;
    let unsafe_ = cfg.unsafe_switches(a.unsafe_reproduction);
    let model_path = a
        .common
        .model
        .clone()
        .or(cfg.model.path.clone())
        .unwrap_or_else(custody_runtime::config::default_model_path);
    if !model_path.exists() {
        bail!(
            "model not found at {}: run scripts/fetch-model.sh or pass --model PATH",
            model_path.display()
        );
    }
    let threads = if a.common.threads > 0 {
        a.common.threads
    } else {
        cfg.engine.threads
    };
    // The node's engine thread computes on the process's default pool (0: one per core).
    crate::common::set_default_pool(threads)?;
    let model = Model::load(&model_path)
        .with_context(|| format!("loading model {}", model_path.display()))?;
    let fingerprint = model.gguf().sha256_hex();
    let mut engine = Engine::new_with_unsafe(model, cfg.engine.clone(), &unsafe_)
        .with_context(|| format!("starting the {role} engine"))?;
    engine.set_release_fill(cfg.disagg.release_fill);
    let node = if a.audit.node != 0 {
        a.audit.node
    } else {
        cfg.audit.node
    };
    let security = fleet_security(&cfg.tls)?;
    let opened = open_node_audit(&a.audit, a.common.config.as_deref())?;
    let mut checkpoints = None;
    if let Some(n) = &opened {
        let sink: Arc<dyn AuditSink> = n.writer.clone();
        engine = engine.with_audit(sink.clone());
        record_start(&mut engine, role, &fingerprint, &unsafe_);
        record_security(&mut engine, &security);
        // The pair keeps each other's checkpoints (where this node's disk cannot reach).
        let peer = if role == "decode" {
            "prefill"
        } else {
            "decode"
        };
        let book = custody_audit::checkpoint::PeerExchange::new(n.latest.clone(), sink, node, peer);
        checkpoints = Some(PeerCheckpoints {
            book: Arc::new(book),
            interval: n.checkpoint_interval,
        });
    }
    Ok(Role {
        cfg,
        engine,
        unsafe_,
        fingerprint,
        node,
        audit: opened.map(|n| n.writer),
        checkpoints,
        security,
    })
}

/// The prefix cache's namespaces of a prefill node whose engine caches (`[prefix_cache]`), each
/// public scope (and the unsafe switch, when armed) recorded in its audit log.
fn prefix_namespaces(r: &mut Role) -> Result<Option<Arc<Namespaces>>> {
    if !r.engine.prefix_cache_enabled() {
        if r.unsafe_.shared_prefix_cache {
            bail!("[unsafe_reproduction] shared_prefix_cache needs engine.prefix_cache = true");
        }
        return Ok(None);
    }
    let tok = custody_runtime::Tokenizer::from_gguf(r.engine.model().gguf())
        .context("the tokenizer, for the prefix cache's public scopes")?;
    let n = Namespaces::from_section(&r.cfg.prefix_cache, &tok, r.unsafe_.shared_prefix_cache)?;
    for line in n.describe() {
        tracing::info!(%line, "prefix cache scope");
        r.engine.record(AuditEvent::Node {
            ts_ns: custody_audit::mono_now_ns(),
            kind: "prefix_scope".into(),
            detail: line,
        });
    }
    Ok(Some(Arc::new(n)))
}

/// How the node talks to the fleet, in its audit log at start: its certificate's identity, or
/// the insecure mode (`node_events` kind `insecure_loopback`).
fn record_security(engine: &mut Engine, security: &Security) {
    let (kind, detail) = match security.own() {
        Some(id) => ("tls", format!("mutual TLS as {id}")),
        None => (
            "insecure_loopback",
            "plaintext gRPC and KV transport, loopback only ([tls] insecure_loopback = true)"
                .to_owned(),
        ),
    };
    engine.record(AuditEvent::Node {
        ts_ns: custody_audit::mono_now_ns(),
        kind: kind.into(),
        detail,
    });
}

/// The node's own facts at start, in its audit log: role, model, context and pool; and, when
/// armed, the unsafe-reproduction switches (so that a log of a deliberate reproduction says so).
pub(crate) fn record_start(
    engine: &mut Engine,
    role: &str,
    fingerprint: &str,
    unsafe_: &UnsafeReproduction,
) {
    engine.record(AuditEvent::Node {
        ts_ns: custody_audit::mono_now_ns(),
        kind: "start".into(),
        detail: format!(
            "role={role} model_sha256={fingerprint} context={} pool_tokens={}",
            engine.context_length(),
            engine.pool().n_pages() * engine.pool().page_size()
        ),
    });
    if unsafe_.any() {
        engine.record(AuditEvent::Node {
            ts_ns: custody_audit::mono_now_ns(),
            kind: "unsafe_reproduction".into(),
            detail: unsafe_.names().join(","),
        });
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// On SIGINT/SIGTERM: drain — refuse new requests (the router retries them elsewhere: nothing
/// was reserved), let the running ones finish (bounded by `timeout`) — then stop serving.
async fn drain_on_signal(
    tx: tokio::sync::oneshot::Sender<()>,
    node: FleetNode,
    drain: Drain,
    timeout: Duration,
) {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
    drain.start();
    tracing::info!(
        timeout_ms = timeout.as_millis() as u64,
        "draining: new requests refused, running ones finish"
    );
    let t0 = Instant::now();
    // Bounded by `timeout`.
    while t0.elapsed() < timeout {
        let left = match &node {
            FleetNode::Prefill(h) => h.stats().await.map(|s| s.live_requests + h.relaying()),
            FleetNode::Decode(h) => h.stats().await.map(|s| s.live_requests + s.reservations),
        };
        if left.is_none_or(|n| n == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::info!(
        drained_ms = t0.elapsed().as_millis() as u64,
        "shutting down"
    );
    let _ = tx.send(());
}

/// Serve `/health/live` and `/health/ready` on `[disagg] health_listen`, when set.
fn serve_health(listen: &str, node: FleetNode) -> Result<()> {
    if listen.is_empty() {
        return Ok(());
    }
    let l = std::net::TcpListener::bind(listen)
        .with_context(|| format!("binding the health endpoint on {listen}"))?;
    let ready: custody_runtime::disagg::health::Readiness = Arc::new(move || node.ready_blocking());
    custody_runtime::disagg::health::spawn(l, ready).context("starting the health endpoint")
}

/// How long a node's gRPC service may take to stop after its drain: open HTTP/2 connections
/// (a router's, kept alive) would otherwise hold it.
const STOP_BOUND: Duration = Duration::from_secs(5);

/// Run a node's gRPC service until it stops, or until `drained` (which tells it to stop) and
/// then at most `STOP_BOUND` more.
async fn serve_until_drained<F>(
    served: F,
    drained: impl std::future::Future<Output = ()>,
) -> Result<()>
where
    F: std::future::Future<Output = Result<(), custody_runtime::disagg::client::ServeError>>
        + Send
        + 'static,
{
    let mut task = tokio::spawn(served);
    let joined = |r: Result<Result<(), _>, tokio::task::JoinError>| match r {
        Ok(r) => r.map_err(anyhow::Error::from),
        Err(e) => Err(anyhow::anyhow!("the node's service task failed: {e}")),
    };
    tokio::select! {
        r = &mut task => return joined(r),
        () = drained => {}
    }
    match tokio::time::timeout(STOP_BOUND, &mut task).await {
        Ok(r) => joined(r),
        Err(_) => {
            tracing::warn!(
                "the service did not stop within {STOP_BOUND:?} of the drain: leaving it"
            );
            task.abort();
            Ok(())
        }
    }
}

fn transport_kind(
    d: &custody_runtime::disagg::config::DisaggSection,
) -> Result<custody_runtime::transport::TransportKind> {
    let device = (!d.verbs_device.is_empty()).then_some(d.verbs_device.as_str());
    custody_runtime::transport::TransportKind::parse(&d.transport, device)
        .context("[disagg] transport")
}

fn addr(s: &str, what: &str) -> Result<SocketAddr> {
    s.parse()
        .with_context(|| format!("invalid {what} address {s:?} (want host:port)"))
}

pub(crate) fn decode(a: RoleArgs) -> Result<()> {
    let r = load_role(&a, "decode")?;
    let control = addr(&r.cfg.disagg.decode_control, "disagg.decode_control")?;
    let opts = DecodeOptions {
        node_id: r.node,
        transport_listen: addr(&r.cfg.disagg.decode_transport, "disagg.decode_transport")?,
        transport_kind: transport_kind(&r.cfg.disagg)?,
        kv_encryption: r
            .security
            .kv_encryption(FleetRole::Decode, r.cfg.disagg.transport_encryption)
            .context("[disagg] transport_encryption")?,
        checksum: r.cfg.disagg.checksum,
        reservation_lease: Duration::from_millis(a.lease_ms),
        unsafe_: r.unsafe_,
        fingerprint: r.fingerprint,
        checkpoints: r.checkpoints,
        drain: Drain::default(),
    };
    let drain = opts.drain.clone();
    let h = DecodeHandle::start(r.engine, opts).context("starting the decode node")?;
    let rt = runtime()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(control)
            .await
            .with_context(|| format!("binding the control plane on {control}"))?;
        eprintln!(
            "decode node {} ready: control {control}, KV transport {} {}",
            r.node, h.info.transport, h.transport_addr
        );
        serve_health(
            &r.cfg.disagg.health_listen,
            FleetNode::Decode(Box::new(h.clone())),
        )?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let timeout = Duration::from_millis(r.cfg.disagg.drain_timeout_ms);
        let drained = drain_on_signal(tx, FleetNode::Decode(Box::new(h.clone())), drain, timeout);
        serve_until_drained(serve_decode(h, listener, r.security, rx), drained)
            .await
            .context("control plane")
    })?;
    if let Some(w) = r.audit {
        crate::common::stop_and_seal(&w)?;
    }
    Ok(())
}

/// How long a prefill node waits for its decode node's control plane before giving up.
const PEER_WAIT_BOUND: Duration = Duration::from_secs(60);
/// First and largest pause between two connection attempts (doubling in between).
const PEER_RETRY_FIRST: Duration = Duration::from_millis(200);
const PEER_RETRY_MAX: Duration = Duration::from_secs(5);

/// Wait for `addr` (the decode node's control plane, which may still be starting) to accept a
/// TCP connection: each failed attempt is logged with what is awaited and the next try, with
/// doubling pauses; after `bound`, a clear error naming the address, the attempts and the last
/// failure.
async fn wait_for_peer(addr: &str, bound: Duration) -> Result<()> {
    let t0 = Instant::now();
    let mut pause = PEER_RETRY_FIRST;
    for attempt in 1u32.. {
        let e = match tokio::net::TcpStream::connect(addr).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let waited = t0.elapsed();
        if waited + pause > bound {
            bail!(
                "decode node control plane at {addr} not reachable after {attempt} attempts in {:.1} s: {e} (is `custody decode` running there, and is [disagg] decode_control right?)",
                waited.as_secs_f64()
            );
        }
        tracing::warn!(
            attempt,
            error = %e,
            retry_in_ms = pause.as_millis() as u64,
            "waiting for the decode node's control plane at {addr}"
        );
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(PEER_RETRY_MAX);
    }
    unreachable!("the loop returns or fails within `bound`")
}

pub(crate) fn prefill(a: RoleArgs) -> Result<()> {
    let mut r = load_role(&a, "prefill")?;
    let namespaces = prefix_namespaces(&mut r)?;
    let listen = addr(&r.cfg.disagg.prefill_listen, "disagg.prefill_listen")?;
    let targets = fleet_targets(&r)?;
    let decode_url = format!("http://{}", r.cfg.disagg.decode_control);
    let opts = PrefillOptions {
        node_id: r.node,
        unsafe_: r.unsafe_,
        fingerprint: r.fingerprint,
        reserve_wait: Duration::from_secs(30),
        transport_kind: transport_kind(&r.cfg.disagg)?,
        kv_encryption: r
            .security
            .kv_encryption(FleetRole::Prefill, r.cfg.disagg.transport_encryption)
            .context("[disagg] transport_encryption")?,
        checkpoints: r.checkpoints,
        namespaces,
        drain: Drain::default(),
    };
    let drain = opts.drain.clone();
    let rt = runtime()?;
    let mut engine = Some(r.engine);
    rt.block_on(async {
        let Some(e) = engine.take() else {
            bail!("engine lost")
        };
        let h = if let Some(targets) = targets {
            // A fleet's prefill node: decode nodes that are down now are paired when they
            // answer; a refused handshake (model, geometry, identity) is final.
            PrefillHandle::start_fleet(e, opts.clone(), &r.security, targets)
                .await
                .context("pairing with the decode nodes")?
        } else {
            // The decode node may still be starting: wait for its control port (bounded), then
            // run the handshake once — a refused handshake is final.
            wait_for_peer(&r.cfg.disagg.decode_control, PEER_WAIT_BOUND).await?;
            PrefillHandle::start(e, opts.clone(), &r.security, &decode_url)
                .await
                .context("pairing with the decode node")?
        };
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding the front door on {listen}"))?;
        eprintln!(
            "prefill node {} ready: front door {listen}, decode {decode_url}",
            r.node
        );
        serve_health(
            &r.cfg.disagg.health_listen,
            FleetNode::Prefill(Box::new(h.clone())),
        )?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let timeout = Duration::from_millis(r.cfg.disagg.drain_timeout_ms);
        let drained = drain_on_signal(tx, FleetNode::Prefill(Box::new(h.clone())), drain, timeout);
        serve_until_drained(serve_prefill(h, listener, r.security.clone(), rx), drained)
            .await
            .context("front door")
    })?;
    if let Some(w) = r.audit {
        crate::common::stop_and_seal(&w)?;
    }
    Ok(())
}

/// `[[disagg.decode]]`: the decode nodes of a fleet's prefill node, each verified by its own
/// identity (`None`: the one-pair `decode_control`).
fn fleet_targets(r: &Role) -> Result<Option<Vec<DecodeTarget>>> {
    if r.cfg.disagg.decode.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(r.cfg.disagg.decode.len());
    for d in &r.cfg.disagg.decode {
        let id = NodeIdentity::new(FleetRole::Decode, d.node);
        let url = format!("http://{}", d.control);
        let kv_encryption = r
            .security
            .kv_encryption_to(id, r.cfg.disagg.transport_encryption)
            .with_context(|| format!("[disagg] transport_encryption to decode node {}", d.node))?;
        let identity = r.security.own().map(|_| id);
        out.push(DecodeTarget {
            url,
            identity,
            kv_encryption,
        });
    }
    Ok(Some(out))
}

pub(crate) fn generate_remote(a: GenerateArgs) -> Result<()> {
    let url = a.prefill.clone().unwrap_or_default();
    let cfg = match &a.common.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    let path = a
        .common
        .model
        .clone()
        .or(cfg.model.path.clone())
        .unwrap_or_else(custody_runtime::config::default_model_path);
    let gguf = custody_runtime::gguf::Gguf::open(&path)
        .with_context(|| format!("reading the tokenizer from {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    let prompt = crate::common::prompt_ids(&tokenizer, a.chat, a.system.as_deref(), &a.prompt)?;
    let req = custody_runtime::GenerateRequest {
        prompt,
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        stop_ids: tokenizer.stop_ids.clone(),
        tenant: a.tenant.clone(),
        cache: None,
    };
    let rt = runtime()?;
    rt.block_on(async {
        use custody_runtime::disagg::proto;
        use tokio_stream::StreamExt;
        // This client asserts the tenant: it must hold a front certificate the node accepts.
        let channel = fleet_security(&cfg.tls)?
            .channel(&url, FleetRole::Prefill)
            .await
            .with_context(|| format!("connecting to the prefill node at {url}"))?;
        let mut client = PrefillClient::new(channel);
        let t0 = Instant::now();
        let mut stream = client
            .generate(proto::GenerateRequest {
                tenant: req.tenant.clone(),
                prompt: req.prompt.clone(),
                max_tokens: req.max_tokens as u32,
                sampling: Some(proto::Sampling {
                    temperature: req.sampling.temperature,
                    top_k: req.sampling.top_k as u32,
                    top_p: req.sampling.top_p,
                    seed: req.sampling.seed,
                }),
                stop_ids: req.stop_ids.clone(),
                cache_salt: String::new(),
                route: None,
            })
            .await
            .map_err(|s| anyhow::anyhow!("request refused: {}", s.message()))?
            .into_inner();
        let mut out = std::io::stdout();
        let mut dec = StreamDecoder::default();
        let (mut n, mut ttft) = (0usize, None);
        while let Some(ev) = stream.next().await {
            let ev = ev.map_err(|s| anyhow::anyhow!("generation failed: {}", s.message()))?;
            let last = !ev.finish_reason.is_empty();
            if !last || ev.generated_tokens as usize > n {
                ttft.get_or_insert_with(|| t0.elapsed());
                n += 1;
                out.write_all(dec.push(&tokenizer, ev.token)?.as_bytes())?;
                out.flush()?;
            }
            if last {
                break;
            }
        }
        writeln!(out)?;
        eprintln!(
            "[{} prompt tokens, {n} generated via {url}; time to first token {:.0} ms, total {:.0} ms]",
            req.prompt.len(),
            ttft.unwrap_or_default().as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unreachable decode node is retried with growing pauses, then a clear error naming the
    /// address and the attempts — within the bound, never an endless silent wait.
    #[test]
    fn an_unreachable_peer_is_a_clear_error_within_the_bound() {
        // A port nothing listens on: bind one, then drop the listener.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .to_string();
        let rt = runtime().expect("runtime");
        let t0 = Instant::now();
        let bound = Duration::from_millis(1500);
        let e = rt
            .block_on(wait_for_peer(&addr, bound))
            .expect_err("nothing listens");
        assert!(
            t0.elapsed() <= bound + Duration::from_millis(500),
            "{:?}",
            t0.elapsed()
        );
        let msg = format!("{e:#}");
        assert!(msg.contains(&addr) && msg.contains("attempts"), "{msg}");
        // 200 + 400 + 800 ms of pauses fit in 1.5 s: at least three attempts.
        let attempts: u32 = msg
            .split(" attempts")
            .next()
            .and_then(|h| h.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .expect("attempt count");
        assert!(attempts >= 3, "{msg}");
    }
}

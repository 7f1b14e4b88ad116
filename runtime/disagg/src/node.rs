//! A node process: a prefill or decode node serving its gRPC service until a signal drains it,
//! with its health endpoint, its start-up facts in its audit log, and (prefill) its wait for the
//! decode node. The binary loads the configuration, the model and the audit writer and hands
//! them over as a [`NodeSetup`]; everything after that is here. Also [`PairOptions::loopback`]:
//! the one builder of an in-process pair's options (the demo's, the benchmarks', the tests').

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use custody_audit::Event as AuditEvent;
use custody_engine::config::UnsafeReproduction;
use custody_engine::prefix_cache::{NamespaceError, Namespaces};

use crate::checkpoints::PeerCheckpoints;
use crate::client::{PairOptions, ServeError, serve_decode, serve_prefill};
use crate::config::DisaggSection;
use crate::decode::{DecodeHandle, DecodeOptions};
use crate::engine::Engine;
use crate::fleet::FleetNode;
use crate::prefill::{DecodeTarget, PrefillHandle, PrefillOptions, PrefillStartError};
use crate::tls::{NodeIdentity, Role, Security, TlsError};
use crate::transport::{TransportError, TransportKind};
use crate::{Drain, health};

/// Why a node process could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("invalid {what} address {addr:?} (want host:port): {source}")]
    Addr {
        what: &'static str,
        addr: String,
        source: std::net::AddrParseError,
    },
    #[error("[disagg] transport: {0}")]
    Transport(#[source] TransportError),
    #[error("[disagg] transport_encryption{peer}: {source}")]
    Encryption { peer: String, source: TlsError },
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        source: std::io::Error,
    },
    #[error("starting the decode node: {0}")]
    DecodeStart(#[source] TransportError),
    #[error("pairing with the decode node: {0}")]
    Pairing(#[source] PrefillStartError),
    #[error(
        "decode node control plane at {addr} not reachable after {attempts} attempts in {secs:.1} s: {last} (is `custody decode` running there, and is [disagg] decode_control right?)"
    )]
    PeerUnreachable {
        addr: String,
        attempts: u32,
        secs: f64,
        last: std::io::Error,
    },
    #[error("{what}: {source}")]
    Serve {
        what: &'static str,
        source: ServeError,
    },
    #[error("the node's service task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    #[error("starting the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("the prefix cache: {0}")]
    PrefixCache(#[source] NamespaceError),
    #[error("the tokenizer, for the prefix cache's public scopes: {0}")]
    Tokenizer(#[source] custody_engine::tokenizer::TokenizerError),
    #[error("[unsafe_reproduction] shared_prefix_cache needs engine.prefix_cache = true")]
    SharedCacheWithoutCache,
    #[error("[kv_offload] needs engine.prefix_cache = true (only cached pages are offloaded)")]
    OffloadWithoutCache,
    #[error(transparent)]
    Offload(#[from] custody_engine::offload::OffloadError),
}

/// What a node process runs on, loaded by the binary from its flags and configuration.
#[derive(Debug)]
pub struct NodeSetup {
    /// The engine, with its audit sink attached (when auditing) and its release fill set.
    pub engine: Engine,
    pub node: u32,
    /// Already armed by `--unsafe-reproduction` (or default).
    pub unsafe_: UnsafeReproduction,
    pub fingerprint: String,
    pub disagg: DisaggSection,
    pub security: Security,
    /// The pair's checkpoint exchange (`None` without an audit writer).
    pub checkpoints: Option<PeerCheckpoints>,
    /// Run without an audit log (`--no-audit`): its health endpoint answers ready as degraded.
    pub audit_off: bool,
    /// The node's log for tenants' promises and proofs (`None` without an audit log).
    pub proofs: Option<Arc<dyn crate::proofs::NodeProofs>>,
    /// `[audit] require_cosignatures`: refuses new work while the log lacks them.
    pub gate: Option<Arc<dyn crate::proofs::AuditGate>>,
}

/// The node's own facts at start, in its audit log: role, model, context and pool; and, when
/// armed, the unsafe-reproduction switches (so that a log of a deliberate reproduction says so).
pub fn record_start(
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

/// How the node talks to the fleet, in its audit log at start: its certificate's identity, or
/// the insecure mode (`node_events` kind `insecure_loopback`).
pub fn record_security(engine: &mut Engine, security: &Security) {
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

/// The prefix cache's namespaces of a prefill node whose engine caches (`[prefix_cache]`), each
/// public scope (and the unsafe switch, when armed) recorded in its audit log. `chat_template`:
/// `[model] chat_template_file`'s text, which renders a scope's `system_prompt` as the front
/// renders chats.
pub fn prefix_namespaces(
    engine: &mut Engine,
    section: &custody_engine::config::PrefixCacheSection,
    unsafe_shared: bool,
    chat_template: Option<String>,
    offload: Option<&custody_engine::offload::OffloadSetup>,
) -> Result<Option<Arc<Namespaces>>, NodeError> {
    if !engine.prefix_cache_enabled() {
        if unsafe_shared {
            return Err(NodeError::SharedCacheWithoutCache);
        }
        if offload.is_some() {
            return Err(NodeError::OffloadWithoutCache);
        }
        return Ok(None);
    }
    let mut tok = custody_engine::Tokenizer::from_gguf(engine.model().gguf())
        .map_err(NodeError::Tokenizer)?;
    if let Some(t) = chat_template {
        tok.set_chat_template(t);
    }
    let n =
        Namespaces::from_section(section, &tok, unsafe_shared).map_err(NodeError::PrefixCache)?;
    for line in n.describe() {
        tracing::info!(%line, "prefix cache scope");
        engine.record(AuditEvent::Node {
            ts_ns: custody_audit::mono_now_ns(),
            kind: "prefix_scope".into(),
            detail: line,
        });
    }
    if let Some(setup) = offload {
        setup.enable(engine, &n)?;
    }
    Ok(Some(Arc::new(n)))
}

/// A multi-threaded runtime for a node's gRPC service.
fn runtime() -> Result<tokio::runtime::Runtime, NodeError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(NodeError::Runtime)
}

fn addr(s: &str, what: &'static str) -> Result<SocketAddr, NodeError> {
    s.parse().map_err(|source| NodeError::Addr {
        what,
        addr: s.to_owned(),
        source,
    })
}

fn transport_kind(d: &DisaggSection) -> Result<TransportKind, NodeError> {
    let device = (!d.verbs_device.is_empty()).then_some(d.verbs_device.as_str());
    TransportKind::parse(&d.transport, device).map_err(NodeError::Transport)
}

/// This node's KV-transfer encryption for its pair's `role` (a fleet's prefill node asks per
/// decode node instead: `kv_encryption_to`).
fn own_kv_encryption(
    s: &NodeSetup,
    role: Role,
) -> Result<crate::transport::KvEncryption, NodeError> {
    s.security
        .kv_encryption(role, s.disagg.transport_encryption)
        .map_err(|source| NodeError::Encryption {
            peer: String::new(),
            source,
        })
}

async fn bind(a: SocketAddr, what: &'static str) -> Result<tokio::net::TcpListener, NodeError> {
    tokio::net::TcpListener::bind(a)
        .await
        .map_err(|source| NodeError::Bind {
            what,
            addr: a.to_string(),
            source,
        })
}

/// Wait for SIGINT or SIGTERM.
async fn signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

/// On SIGINT/SIGTERM: drain — refuse new requests (the router retries them elsewhere: nothing
/// was reserved), let the running ones finish (bounded by `timeout`) — then stop serving.
async fn drain_on_signal(
    tx: tokio::sync::oneshot::Sender<()>,
    node: FleetNode,
    drain: Drain,
    timeout: Duration,
) {
    signal().await;
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
    if tx.send(()).is_err() {
        // The service already stopped on its own: nothing left to tell.
        tracing::debug!("the service had stopped before the drain ended");
    }
}

/// Serve `/health/live` and `/health/ready` on `[disagg] health_listen`, when set; a node without
/// its audit log answers ready as degraded, one whose `gate` refuses work is not ready.
fn serve_health(
    listen: &str,
    node: FleetNode,
    audit_off: bool,
    gate: Option<Arc<dyn crate::proofs::AuditGate>>,
) -> Result<(), NodeError> {
    if listen.is_empty() {
        return Ok(());
    }
    let bind_err = |source| NodeError::Bind {
        what: "the health endpoint",
        addr: listen.to_owned(),
        source,
    };
    let l = std::net::TcpListener::bind(listen).map_err(bind_err)?;
    let ready: health::Readiness =
        Arc::new(move || match gate.as_ref().and_then(|g| g.refusal()) {
            Some(why) => Err(format!("audit_uncosigned: {why}")),
            None => node.ready_blocking(),
        });
    let degraded = audit_off.then_some("audit disabled");
    health::spawn_degraded(l, ready, degraded).map_err(bind_err)
}

/// How long a node's gRPC service may take to stop after its drain: open HTTP/2 connections
/// (a router's, kept alive) would otherwise hold it.
const STOP_BOUND: Duration = Duration::from_secs(5);

/// Run a node's gRPC service until it stops, or until `drained` (which tells it to stop) and
/// then at most `STOP_BOUND` more.
async fn serve_until_drained<F>(
    served: F,
    drained: impl std::future::Future<Output = ()>,
    what: &'static str,
) -> Result<(), NodeError>
where
    F: std::future::Future<Output = Result<(), ServeError>> + Send + 'static,
{
    let mut task = tokio::spawn(served);
    let joined = |r: Result<Result<(), ServeError>, tokio::task::JoinError>| match r {
        Ok(r) => r.map_err(|source| NodeError::Serve { what, source }),
        Err(e) => Err(NodeError::Task(e)),
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

/// The constraint compiler over `engine`'s vocabulary (each node that samples compiles the
/// constraints it is sent), or `None` with the reason logged.
fn grammars_of(engine: &Engine) -> Option<Arc<custody_engine::grammar::Grammars>> {
    let built = custody_engine::Tokenizer::from_gguf(engine.model().gguf())
        .map_err(|e| e.to_string())
        .and_then(|t| {
            custody_engine::grammar::Grammars::for_tokenizer(Arc::new(t)).map_err(|e| e.to_string())
        });
    match built {
        Ok(g) => Some(Arc::new(g)),
        Err(e) => {
            tracing::warn!(error = %e, "no constraint compiler: constrained requests will be refused");
            None
        }
    }
}

/// A decode node: its engine thread and KV transport target, its control plane, until drained.
pub fn run_decode(s: NodeSetup, reservation_lease: Duration) -> Result<(), NodeError> {
    let control = addr(&s.disagg.decode_control, "disagg.decode_control")?;
    let opts = DecodeOptions {
        grammars: grammars_of(&s.engine),
        node_id: s.node,
        transport_listen: addr(&s.disagg.decode_transport, "disagg.decode_transport")?,
        transport_kind: transport_kind(&s.disagg)?,
        kv_encryption: own_kv_encryption(&s, Role::Decode)?,
        checksum: s.disagg.checksum,
        reservation_lease,
        unsafe_: s.unsafe_,
        fingerprint: s.fingerprint,
        checkpoints: s.checkpoints,
        drain: Drain::default(),
        proofs: s.proofs.clone(),
        gate: s.gate.clone(),
    };
    let drain = opts.drain.clone();
    let h = DecodeHandle::start(s.engine, opts).map_err(NodeError::DecodeStart)?;
    runtime()?.block_on(async {
        let listener = bind(control, "the control plane").await?;
        tracing::info!(
            node = s.node,
            %control,
            transport = %h.info.transport,
            transport_addr = %h.transport_addr,
            "decode node ready"
        );
        let node = || FleetNode::Decode(Box::new(h.clone()));
        serve_health(&s.disagg.health_listen, node(), s.audit_off, s.gate.clone())?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let timeout = Duration::from_millis(s.disagg.drain_timeout_ms);
        let drained = drain_on_signal(tx, node(), drain, timeout);
        let served = serve_decode(h.clone(), listener, s.security, rx);
        serve_until_drained(served, drained, "control plane").await
    })
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
async fn wait_for_peer(addr: &str, bound: Duration) -> Result<(), NodeError> {
    let t0 = Instant::now();
    let mut pause = PEER_RETRY_FIRST;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let e = match tokio::net::TcpStream::connect(addr).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let waited = t0.elapsed();
        if waited + pause > bound {
            return Err(NodeError::PeerUnreachable {
                addr: addr.to_owned(),
                attempts: attempt,
                secs: waited.as_secs_f64(),
                last: e,
            });
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
}

/// `[[disagg.decode]]`: the decode nodes of a fleet's prefill node, each verified by its own
/// identity (`None`: the one-pair `decode_control`).
fn fleet_targets(s: &NodeSetup) -> Result<Option<Vec<DecodeTarget>>, NodeError> {
    if s.disagg.decode.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(s.disagg.decode.len());
    for d in &s.disagg.decode {
        let id = NodeIdentity::new(Role::Decode, d.node);
        let kv_encryption = s
            .security
            .kv_encryption_to(id, s.disagg.transport_encryption)
            .map_err(|source| NodeError::Encryption {
                peer: format!(" to decode node {}", d.node),
                source,
            })?;
        out.push(DecodeTarget {
            url: format!("http://{}", d.control),
            identity: s.security.own().map(|_| id),
            kv_encryption,
        });
    }
    Ok(Some(out))
}

/// A prefill node: paired with its decode node (or a fleet's), its front door, until drained.
pub fn run_prefill(mut s: NodeSetup, namespaces: Option<Arc<Namespaces>>) -> Result<(), NodeError> {
    let listen = addr(&s.disagg.prefill_listen, "disagg.prefill_listen")?;
    let targets = fleet_targets(&s)?;
    let opts = PrefillOptions {
        grammars: grammars_of(&s.engine),
        node_id: s.node,
        unsafe_: std::mem::take(&mut s.unsafe_),
        fingerprint: std::mem::take(&mut s.fingerprint),
        reserve_wait: Duration::from_secs(30),
        transport_kind: transport_kind(&s.disagg)?,
        kv_encryption: own_kv_encryption(&s, Role::Prefill)?,
        checkpoints: s.checkpoints.take(),
        namespaces,
        drain: Drain::default(),
        proofs: s.proofs.clone(),
        gate: s.gate.clone(),
    };
    let rt = runtime()?;
    rt.block_on(serve_prefill_node(s, opts, targets, listen))
}

/// [`run_prefill`] inside its runtime.
async fn serve_prefill_node(
    s: NodeSetup,
    opts: PrefillOptions,
    targets: Option<Vec<DecodeTarget>>,
    listen: SocketAddr,
) -> Result<(), NodeError> {
    let drain = opts.drain.clone();
    let decode_url = format!("http://{}", s.disagg.decode_control);
    let h = match targets {
        // A fleet's prefill node: decode nodes that are down now are paired when they answer;
        // a refused handshake (model, geometry, identity) is final.
        Some(targets) => PrefillHandle::start_fleet(s.engine, opts, &s.security, targets).await,
        None => {
            // The decode node may still be starting: wait for its control port (bounded), then
            // run the handshake once — a refused handshake is final.
            wait_for_peer(&s.disagg.decode_control, PEER_WAIT_BOUND).await?;
            PrefillHandle::start(s.engine, opts, &s.security, &decode_url).await
        }
    }
    .map_err(NodeError::Pairing)?;
    let listener = bind(listen, "the front door").await?;
    tracing::info!(node = s.node, %listen, decode = %decode_url, "prefill node ready");
    let node = || FleetNode::Prefill(Box::new(h.clone()));
    serve_health(&s.disagg.health_listen, node(), s.audit_off, s.gate.clone())?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let timeout = Duration::from_millis(s.disagg.drain_timeout_ms);
    let drained = drain_on_signal(tx, node(), drain, timeout);
    let served = serve_prefill(h.clone(), listener, s.security.clone(), rx);
    serve_until_drained(served, drained, "front door").await
}

impl PairOptions {
    /// An in-process pair on loopback — prefill node 1, decode node 2 (transport on any port,
    /// checksummed), 30 s reservation wait and lease, no checkpoint exchange, no prefix cache —
    /// with `fleet`'s certificates (`None`: plaintext) and the `unsafe_` switches on both nodes.
    pub fn loopback(
        fingerprint: &str,
        unsafe_: UnsafeReproduction,
        fleet: Option<Arc<crate::tls::Fleet>>,
    ) -> Self {
        Self {
            prefill: PrefillOptions {
                node_id: 1,
                unsafe_: unsafe_.clone(),
                fingerprint: fingerprint.to_owned(),
                reserve_wait: Duration::from_secs(30),
                transport_kind: TransportKind::default(),
                kv_encryption: Default::default(),
                checkpoints: None,
                namespaces: None,
                grammars: None,
                drain: Drain::default(),
                proofs: None,
                gate: None,
            },
            decode: DecodeOptions {
                grammars: None,
                node_id: 2,
                transport_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                transport_kind: TransportKind::default(),
                kv_encryption: Default::default(),
                checksum: true,
                reservation_lease: Duration::from_secs(30),
                unsafe_,
                fingerprint: fingerprint.to_owned(),
                checkpoints: None,
                drain: Drain::default(),
                proofs: None,
                gate: None,
            },
            fleet,
            transport_encryption: false,
        }
    }
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
        let msg = e.to_string();
        assert!(msg.contains(&addr) && msg.contains("attempts"), "{msg}");
        // 200 + 400 + 800 ms of pauses fit in 1.5 s: at least three attempts.
        let NodeError::PeerUnreachable { attempts, .. } = e else {
            panic!("{msg}")
        };
        assert!(attempts >= 3, "{msg}");
    }

    /// The pair's one builder: the nodes' ids, loopback, checksums on.
    #[test]
    fn loopback_pair_options_name_both_nodes() {
        let o = PairOptions::loopback("f", UnsafeReproduction::default(), None);
        assert_eq!((o.prefill.node_id, o.decode.node_id), (1, 2));
        assert!(o.decode.checksum && o.decode.transport_listen.ip().is_loopback());
        assert!(o.fleet.is_none() && !o.transport_encryption);
    }
}

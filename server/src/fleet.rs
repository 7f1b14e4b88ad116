//! The router: `custody serve` in front of N prefill × M decode nodes (`[fleet]`).
//!
//! # What it does per request
//! 1. **Checks** the request against the fleet before anything is reserved anywhere: prompt +
//!    `max_tokens` within the context every node states, and the pages it needs within a
//!    decode node's pool (the prefill node's own admission checks again: the incident's lesson
//!    is to rely neither on a proxy alone nor on the engine alone).
//! 2. **Chooses** a prefill node (`custody_router::policy::choose_prefill`: cache affinity within
//!    the request's own namespace — its chain keys, computed with the fleet's prefix-cache
//!    secret from the *authenticated* tenant — above a match ratio, else least loaded, with an
//!    imbalance guard) and a decode node among that prefill node's live peers
//!    (power-of-two-choices on free pages).
//! 3. **Mints a route** — a transfer id unique in this router's log, bound to (tenant, request,
//!    prefill, decode, the decode node's epoch) — and sends it with the request. The decode node
//!    refuses a route naming another epoch (a restarted node), so a stale route never reserves
//!    a page and no write of it can land. (The nodes check the pair and the epoch; the tenant
//!    binding is the logs': this router's row names the tenant, each node's its own request,
//!    and `custody forensics fleet` reports any `tenant_mismatch`.)
//! 4. **Retries** on another pair only when the failed attempt says no KV write of it was
//!    posted (`NOTHING_POSTED_KEY`, set by the prefill node before its writes), or when the call
//!    never reached the prefill node. Anything else fails closed: the nodes abort and quarantine
//!    on their side, the client gets a clean error.
//!
//! # The registry and health
//! Each node's load report (`Fleet.Load`, also the active probe) is asked for every
//! `probe_interval_ms`; each answer, timeout and failed request drives the node's
//! `custody_router::health::Health` (pending → ready → not-ready → failed). Between reports the
//! router counts what it routed itself (queued requests, reserved pages) so that a burst does
//! not pile onto one node.
//!
//! # The record
//! The router is a node of its own with its own signed log (`node_events`): kind `route`, one row
//! per decision, admission, retry, refusal and end (`request=<router's> transfer=… outcome=…`
//! and the alternatives' load), and kind `health`, one row per health transition. The prefill
//! and decode nodes record the same transfer id beside their own request ids (kind `route`),
//! which is how `custody forensics request` follows a request across the fleet.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use custody_audit as audit;
use custody_router::health::{Health, HealthState, HealthThresholds, Observation, Transition};
use custody_router::index::PrefixIndex;
use custody_router::policy::{
    DecodeCandidate, PolicyConfig, PrefillCandidate, choose_decode, choose_prefill,
};
use custody_router::rng::SplitMix64;
use custody_router::{ChainKey, NodeId};
use custody_runtime::disagg::proto::{
    self, fleet_client::FleetClient, prefill_client::PrefillClient,
};
use custody_runtime::disagg::tls::{NodeIdentity, Role, Security};
use custody_runtime::engine::GenerateRequest;
use custody_runtime::prefix_cache::Namespaces;
use tonic::transport::Channel;

use crate::backend::{self, Admitted, Anomaly, Refused, RelayEnd};
use crate::config::FleetSection;
use crate::engine_thread::{EngineGauges, PrefillCheck};
use crate::error::ApiError;

/// The `node_events` kinds of the router's log.
pub const ROUTE_EVENT: &str = "route";
pub const HEALTH_EVENT: &str = "health";

/// A worker's role in the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum WorkerRole {
    Prefill,
    Decode,
}

impl WorkerRole {
    fn name(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

/// One node as the registry knows it.
#[derive(Debug)]
struct Worker {
    url: String,
    health: Health,
    /// Its last load report (`None` until one arrived).
    report: Option<proto::LoadReport>,
    /// Requests (prefill) or pages (decode) this router routed to it since that report.
    routed_since_report: u64,
    /// Why it is held out although it answers (an incompatible model or geometry).
    incompatible: Option<String>,
}

/// What the router itself requires of every node.
#[derive(Clone, Debug)]
struct Expected {
    fingerprint: String,
    context_length: u64,
}

/// Fleet-wide geometry every node must state (the first compatible report sets it).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Geometry {
    fingerprint: String,
    page_size: u32,
    context_length: u64,
    kv_dtype: String,
    n_layers: u32,
    kv_dim: u32,
}

impl Geometry {
    fn of(r: &proto::LoadReport) -> Self {
        Self {
            fingerprint: r.model_fingerprint.clone(),
            page_size: r.page_size,
            context_length: r.context_length,
            kv_dtype: r.kv_dtype.clone(),
            n_layers: r.n_layers,
            kv_dim: r.kv_dim,
        }
    }
}

#[derive(Debug)]
struct State {
    workers: BTreeMap<(WorkerRole, NodeId), Worker>,
    geometry: Option<Geometry>,
    index: PrefixIndex,
    rng: SplitMix64,
    /// The routable pairs by prefill node, recomputed when a node's health, epoch or links
    /// change, and at least every `PAIRS_TTL_MS` (a circuit's cooldown ends by the clock): not
    /// per decision, which at 64 × 64 would walk 4,096 links each time.
    pairs: Vec<PrefillLinks>,
    pairs_at_ms: Option<u64>,
}

/// A routable prefill node and its routable decode peers, each at the epoch both agree on.
#[derive(Clone, Debug)]
struct PrefillLinks {
    prefill: NodeId,
    decodes: Vec<(NodeId, u64)>,
}

/// How long the routable pairs are reused at most.
const PAIRS_TTL_MS: u64 = 100;

impl State {
    /// The routable pairs now (cached; see `pairs`).
    fn routable(&mut self, now_ms: u64) -> &[PrefillLinks] {
        let fresh = self
            .pairs_at_ms
            .is_some_and(|at| now_ms.saturating_sub(at) < PAIRS_TTL_MS);
        if !fresh {
            let mut by_prefill: BTreeMap<NodeId, Vec<(NodeId, u64)>> = BTreeMap::new();
            for p in routable_pairs(self, now_ms) {
                by_prefill
                    .entry(p.prefill)
                    .or_default()
                    .push((p.decode, p.epoch));
            }
            self.pairs = by_prefill
                .into_iter()
                .map(|(prefill, decodes)| PrefillLinks { prefill, decodes })
                .collect();
            self.pairs_at_ms = Some(now_ms);
        }
        &self.pairs
    }

    /// Something routing depends on changed: the next decision recomputes the pairs.
    fn invalidate_pairs(&mut self) {
        self.pairs_at_ms = None;
    }
}

/// The router's counters (`/metrics`, the benchmark).
#[derive(Debug, Default)]
pub struct RouterStats {
    pub decisions: AtomicU64,
    pub retries: AtomicU64,
    pub refused: AtomicU64,
    pub failed: AtomicU64,
}

/// The router (shared by every HTTP request).
pub struct Router {
    node: u32,
    cfg: FleetSection,
    thresholds: HealthThresholds,
    policy: PolicyConfig,
    state: Mutex<State>,
    prefill_clients: BTreeMap<NodeId, PrefillClient<Channel>>,
    audit: Option<Arc<dyn audit::AuditSink>>,
    namespaces: Option<Arc<Namespaces>>,
    /// The model file's fingerprint and the router's context: a node stating others is never
    /// routed to.
    expected: Expected,
    gauges: Arc<EngineGauges>,
    check: PrefillCheck,
    next_request: AtomicU64,
    /// Transfer ids: a random 64-bit base per router process plus a counter (unique in its log
    /// and across its restarts, with overwhelming probability).
    transfer_base: u64,
    next_transfer: AtomicU64,
    started: Instant,
    pub stats: RouterStats,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("[fleet]: {0}")]
    Config(String),
    #[error("[fleet] node {node} at {url}: {source}")]
    Channel {
        node: u32,
        url: String,
        source: custody_runtime::disagg::tls::ChannelError,
    },
}

/// What the router needs besides `[fleet]`.
#[derive(Clone)]
pub struct RouterParts {
    /// This router's node id (its audit log's).
    pub node: u32,
    pub audit: Option<Arc<dyn audit::AuditSink>>,
    /// The fleet's prefix-cache namespaces (its secret), for cache affinity; `None`: routing by
    /// load only.
    pub namespaces: Option<Arc<Namespaces>>,
    pub fingerprint: String,
    /// The context every node must state (the router's own; 0: the first report's).
    pub context_length: u64,
}

impl std::fmt::Debug for RouterParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterParts")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl Router {
    /// The registry from `cfg` (every node pending), and one probe task per node.
    pub fn start(
        cfg: FleetSection,
        security: &Security,
        parts: RouterParts,
        gauges: Arc<EngineGauges>,
        check: PrefillCheck,
    ) -> Result<Arc<Self>, RouterError> {
        cfg.validate()
            .map_err(|e| RouterError::Config(e.to_string()))?;
        let thresholds = HealthThresholds {
            ready_after_ok: cfg.ready_after_ok,
            not_ready_after_failures: cfg.not_ready_after_failures,
            failed_after_failures: cfg.failed_after_failures,
            circuit_open_ms: cfg.circuit_open_ms,
        };
        thresholds
            .validate()
            .map_err(|e| RouterError::Config(e.to_string()))?;
        let policy = PolicyConfig {
            cache_match_ratio: cfg.cache_match_ratio,
            balance_abs_requests: cfg.balance_abs_requests,
            balance_rel: cfg.balance_rel,
        };
        policy
            .validate()
            .map_err(|e| RouterError::Config(e.to_string()))?;
        let random = custody_runtime::transport::pairing::random_u64()
            .map_err(|e| RouterError::Config(format!("no randomness: {e}")))?;
        let seed = if cfg.seed != 0 { cfg.seed } else { random };
        let mut probes = Vec::new();
        let mut prefill_clients = BTreeMap::new();
        for (role, list) in [
            (WorkerRole::Prefill, &cfg.prefill),
            (WorkerRole::Decode, &cfg.decode),
        ] {
            for n in list {
                let id = NodeIdentity::new(
                    match role {
                        WorkerRole::Prefill => Role::Prefill,
                        WorkerRole::Decode => Role::Decode,
                    },
                    n.node,
                );
                let channel =
                    lazy_channel(security, &n.url, id).map_err(|source| RouterError::Channel {
                        node: n.node,
                        url: n.url.clone(),
                        source,
                    })?;
                if role == WorkerRole::Prefill {
                    prefill_clients.insert(n.node, PrefillClient::new(channel.clone()));
                }
                probes.push((role, n.node, FleetClient::new(channel)));
            }
        }
        let router = Arc::new(Self::assemble(Assembly {
            cfg,
            thresholds,
            policy,
            parts,
            prefill_clients,
            gauges,
            check,
            seed,
            transfer_base: random & !0xffff_ffff,
        }));
        for (role, node, client) in probes {
            tokio::spawn(probe_loop(Arc::downgrade(&router), role, node, client));
        }
        Ok(router)
    }

    /// The fleet's context length (from the first compatible report).
    pub fn context_length(&self) -> Option<usize> {
        self.lock()
            .geometry
            .as_ref()
            .map(|g| g.context_length as usize)
    }

    pub fn gauges(&self) -> &Arc<EngineGauges> {
        &self.gauges
    }

    /// The prefill nodes' front doors, by node id (for tenants' proofs).
    pub fn prefill_clients(&self) -> Vec<(NodeId, PrefillClient<Channel>)> {
        self.prefill_clients
            .iter()
            .map(|(n, c)| (*n, c.clone()))
            .collect()
    }

    pub fn audit(&self) -> Option<Arc<dyn audit::AuditSink>> {
        self.audit.clone()
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether at least one prefill node and one of its decode peers are routable now (the
    /// router's `/health/ready`).
    pub fn ready(&self) -> Result<(), String> {
        let st = self.lock();
        let now = self.now_ms();
        let pairs = routable_pairs(&st, now);
        if pairs.is_empty() {
            Err("no routable prefill/decode pair".into())
        } else {
            Ok(())
        }
    }

    /// Each node's health state now, by (role, node id).
    pub fn health_states(&self) -> Vec<(WorkerRole, NodeId, HealthState)> {
        self.lock()
            .workers
            .iter()
            .map(|(&(r, n), w)| (r, n, w.health.state()))
            .collect()
    }

    /// The registry and the router's counters, in Prometheus' text format.
    pub fn metrics_text(&self) -> String {
        use std::fmt::Write as _;
        let mut o = String::new();
        o.push_str("# HELP custody_fleet_node_state A fleet node's health state (1 for its current one).\n# TYPE custody_fleet_node_state gauge\n");
        for (role, node, state) in self.health_states() {
            let _ = writeln!(
                o,
                "custody_fleet_node_state{{role=\"{}\",node=\"{node}\",state=\"{}\"}} 1",
                role.name(),
                state.name()
            );
        }
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (name, help, v) in [
            (
                "custody_router_decisions_total",
                "Routing decisions (one per attempt).",
                ld(&self.stats.decisions),
            ),
            (
                "custody_router_retries_total",
                "Attempts retried on another pair (nothing of them was posted).",
                ld(&self.stats.retries),
            ),
            (
                "custody_router_refused_total",
                "Requests refused before any attempt (length, capacity, no pair).",
                ld(&self.stats.refused),
            ),
            (
                "custody_router_failed_total",
                "Requests failed closed.",
                ld(&self.stats.failed),
            ),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        o
    }

    fn observe_probe(&self, role: WorkerRole, node: NodeId, r: Result<proto::LoadReport, String>) {
        let now = self.now_ms();
        let mut events = Vec::new();
        {
            let mut st = self.lock();
            let State {
                workers,
                geometry,
                index,
                ..
            } = &mut *st;
            let Some(w) = workers.get_mut(&(role, node)) else {
                return;
            };
            let links_changed = match (&r, &w.report) {
                (Ok(new), Some(old)) => {
                    new.epoch != old.epoch
                        || new.decode_peers != old.decode_peers
                        || new.draining != old.draining
                }
                _ => true,
            };
            let obs = match &r {
                Ok(rep) => {
                    let restarted = w.report.as_ref().is_some_and(|o| o.epoch != rep.epoch);
                    if restarted && role == WorkerRole::Prefill {
                        // Its cache is gone with its process.
                        index.forget_node(node);
                    }
                    w.incompatible = compatibility(&self.expected, geometry, rep, node);
                    w.report = Some(rep.clone());
                    w.routed_since_report = 0;
                    match &w.incompatible {
                        Some(_) => Observation::ProbeFailed,
                        None => Observation::ProbeOk {
                            draining: rep.draining,
                        },
                    }
                }
                Err(_) => Observation::ProbeFailed,
            };
            let transition = w.health.observe(obs, now, &self.thresholds);
            if let Some(t) = &transition {
                let why = match (&r, &w.incompatible) {
                    (_, Some(i)) => i.clone(),
                    (Err(e), _) => e.clone(),
                    (Ok(_), None) => String::new(),
                };
                events.push((t.to, health_detail(role, node, &w.url, t, &why)));
            }
            if links_changed || transition.is_some() {
                st.invalidate_pairs();
            }
        }
        for (to, d) in events {
            if to == HealthState::Ready {
                tracing::info!(detail = %d, "fleet node health");
            } else {
                tracing::warn!(detail = %d, "fleet node health");
            }
            self.record(HEALTH_EVENT, d);
        }
    }

    fn observe_request_failure(&self, role: WorkerRole, node: NodeId) {
        let now = self.now_ms();
        let t = {
            let mut st = self.lock();
            // A failed request opens the node's circuit: routing changes.
            st.invalidate_pairs();
            st.workers.get_mut(&(role, node)).and_then(|w| {
                w.health
                    .observe(Observation::RequestFailed, now, &self.thresholds)
                    .map(|t| (t, w.url.clone()))
            })
        };
        if let Some((t, url)) = t {
            let d = health_detail(role, node, &url, &t, "a request to it failed");
            tracing::warn!(detail = %d, "fleet node health");
            self.record(HEALTH_EVENT, d);
        }
    }

    /// Record a `node_events` row in the router's log (fail-closed writer: off the async
    /// workers; a failure is logged and counted like every server-side event).
    fn record(&self, kind: &str, detail: String) {
        let Some(sink) = self.audit.clone() else {
            return;
        };
        let ev = audit::Event::Node {
            ts_ns: audit::mono_now_ns(),
            kind: kind.into(),
            detail,
        };
        tokio::task::spawn_blocking(move || {
            if let Err(e) = sink.record(ev) {
                tracing::error!(error = %e, "recording a router event failed");
            }
        });
    }

    /// [`Self::record`], awaited: the row is in the writer's queue when this returns. A log
    /// that cannot take it fails closed: the router stops routing (`audit_failed`, 503).
    async fn record_ahead(&self, kind: &str, detail: String) -> Result<(), ApiError> {
        let Some(sink) = self.audit.clone() else {
            return Ok(());
        };
        let ev = audit::Event::Node {
            ts_ns: audit::mono_now_ns(),
            kind: kind.into(),
            detail,
        };
        let failed = match tokio::task::spawn_blocking(move || sink.record(ev)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        tracing::error!(error = %failed, "recording a route failed: the router stops routing");
        self.gauges.audit_failed.store(true, Ordering::Relaxed);
        Err(ApiError::unavailable(
            format!("the router's audit log is unavailable: {failed}"),
            "audit_unavailable",
        ))
    }

    /// Route `req` (its tenant authenticated by the HTTP side), retrying on another pair only
    /// while no KV write of an attempt was posted.
    pub(crate) async fn submit(
        self: &Arc<Self>,
        req: GenerateRequest,
        cache_salt: &str,
    ) -> Result<Admitted, Refused> {
        let request = self.next_request.fetch_add(1, Ordering::Relaxed);
        let keys = self.chain_keys(&req, cache_salt);
        let mut excluded = Excluded::default();
        let mut last_error = None;
        for attempt in 1..=self.cfg.max_attempts {
            let t_plan = Instant::now();
            let plan = match self.plan(&req, &keys, &excluded) {
                Ok(p) => p,
                Err(e) => {
                    self.stats.refused.fetch_add(1, Ordering::Relaxed);
                    let why = last_error.take().unwrap_or(e.why.clone());
                    self.record(
                        ROUTE_EVENT,
                        format!(
                            "request={request} tenant={:?} attempt={attempt} outcome=refused why={why:?}",
                            req.tenant
                        ),
                    );
                    return Err((None, e.error));
                }
            };
            self.stats.decisions.fetch_add(1, Ordering::Relaxed);
            let route = self.mint(&plan, attempt);
            // In the log's writer before the route leaves this process.
            self.record_ahead(ROUTE_EVENT, plan.detail(request, &req.tenant, &route))
                .await
                .map_err(|e| (None, e))?;
            let t_attempt = Instant::now();
            let attempted = self.attempt(&req, cache_salt, &plan, route).await;
            tracing::debug!(
                plan_us = (t_attempt - t_plan).as_micros() as u64,
                attempt_us = t_attempt.elapsed().as_micros() as u64,
                "routed"
            );
            match attempted {
                Ok(admitted) => {
                    self.lock().index.record(plan.prefill, &keys);
                    self.check_anomaly(plan.prefill, &req.tenant, req.prompt.len(), &admitted.1)
                        .await;
                    return Ok(self.admitted(request, &req, &plan, &route, admitted));
                }
                Err(Failure::Retry { why, culprit }) => {
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    self.record(
                        ROUTE_EVENT,
                        format!(
                            "request={request} tenant={:?} transfer={} attempt={attempt} prefill={} decode={} outcome=retry why={why:?}",
                            req.tenant, route.transfer_id, plan.prefill, plan.decode
                        ),
                    );
                    match culprit {
                        WorkerRole::Prefill => excluded.prefill.push(plan.prefill),
                        WorkerRole::Decode => excluded.decode.push(plan.decode),
                    }
                    last_error = Some(why);
                }
                Err(Failure::Closed { why, error }) => {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    self.record(
                        ROUTE_EVENT,
                        format!(
                            "request={request} tenant={:?} transfer={} attempt={attempt} prefill={} decode={} outcome=failed why={why:?}",
                            req.tenant, route.transfer_id, plan.prefill, plan.decode
                        ),
                    );
                    return Err((None, error));
                }
            }
        }
        self.stats.failed.fetch_add(1, Ordering::Relaxed);
        let why = last_error.unwrap_or_default();
        self.record(
            ROUTE_EVENT,
            format!(
                "request={request} tenant={:?} outcome=failed why={:?}",
                req.tenant,
                format!("{} attempts: {why}", self.cfg.max_attempts)
            ),
        );
        Err((
            None,
            ApiError::unavailable(
                format!(
                    "no prefill/decode pair could take the request after {} attempts (nothing was written anywhere): {why}",
                    self.cfg.max_attempts
                ),
                "backend_unavailable",
            ),
        ))
    }

    /// The request's chain keys within its own namespace (empty without the fleet's secret).
    fn chain_keys(&self, req: &GenerateRequest, cache_salt: &str) -> Vec<ChainKey> {
        let (Some(ns), Some(page_size)) = (&self.namespaces, self.page_size()) else {
            return Vec::new();
        };
        let salt = (!cache_salt.is_empty()).then_some(cache_salt);
        let scope = ns.scope(&req.tenant, salt, &req.prompt);
        let full = req.prompt.len() / page_size;
        scope
            .chain(&req.prompt, page_size, full)
            .into_iter()
            .map(|l| l.key)
            .collect()
    }

    fn page_size(&self) -> Option<usize> {
        self.lock()
            .geometry
            .as_ref()
            .map(|g| g.page_size as usize)
            .filter(|&p| p > 0)
    }

    fn mint(&self, plan: &Plan, attempt: u32) -> proto::Route {
        let seq = self.next_transfer.fetch_add(1, Ordering::Relaxed);
        proto::Route {
            transfer_id: self.transfer_base | (seq & 0xffff_ffff),
            router_node: self.node,
            prefill_node: plan.prefill,
            decode_node: plan.decode,
            decode_epoch: plan.decode_epoch,
            attempt,
        }
    }

    /// The checks and the choice, under the registry's lock (no await inside).
    fn plan(
        &self,
        req: &GenerateRequest,
        keys: &[ChainKey],
        excluded: &Excluded,
    ) -> Result<Plan, Refusal> {
        let now = self.now_ms();
        let mut st = self.lock();
        let geometry = st
            .geometry
            .clone()
            .ok_or_else(|| Refusal::unavailable("no fleet node has reported yet"))?;
        check_length(req, &geometry, &st)?;
        let need_pages =
            (req.prompt.len() + req.max_tokens).div_ceil(geometry.page_size.max(1) as usize) as u32;
        st.routable(now);
        let State {
            workers,
            index,
            rng,
            pairs,
            ..
        } = &mut *st;
        let usable = |l: &&PrefillLinks| {
            !excluded.prefill.contains(&l.prefill)
                && l.decodes.iter().any(|(d, _)| !excluded.decode.contains(d))
        };
        let prefills: Vec<PrefillCandidate> = pairs
            .iter()
            .filter(usable)
            .filter_map(|l| {
                let w = workers.get(&(WorkerRole::Prefill, l.prefill))?;
                let rep = w.report.as_ref()?;
                Some(PrefillCandidate {
                    node: l.prefill,
                    queued_requests: rep.live_requests + w.routed_since_report as u32,
                    free_pages: rep.free_pages as u32,
                })
            })
            .collect();
        let p = choose_prefill(&prefills, keys, index, &self.policy)
            .ok_or_else(|| Refusal::unavailable("no routable prefill node"))?;
        let peers = pairs
            .iter()
            .find(|l| l.prefill == p.node)
            .map_or(&[][..], |l| &l.decodes[..]);
        let decodes: Vec<DecodeCandidate> = peers
            .iter()
            .filter(|(d, _)| !excluded.decode.contains(d))
            .filter_map(|&(d, _)| {
                let w = workers.get(&(WorkerRole::Decode, d))?;
                let rep = w.report.as_ref()?;
                Some(DecodeCandidate {
                    node: d,
                    free_pages: (rep.free_pages.saturating_sub(w.routed_since_report)) as u32,
                    live_requests: rep.live_requests,
                })
            })
            .collect();
        let d = choose_decode(&decodes, need_pages, rng).ok_or_else(|| {
            Refusal::busy("no decode node paired with the chosen prefill node has the pages free")
        })?;
        let decode_epoch = peers
            .iter()
            .find(|(n, _)| *n == d.node)
            .map_or(0, |&(_, e)| e);
        // Count what this router sent until the next reports say it.
        if let Some(w) = workers.get_mut(&(WorkerRole::Prefill, p.node)) {
            w.routed_since_report += 1;
        }
        if let Some(w) = workers.get_mut(&(WorkerRole::Decode, d.node)) {
            w.routed_since_report += u64::from(need_pages);
        }
        let alternatives = alternatives(&prefills, &p, &decodes, &d);
        Ok(Plan {
            prefill: p.node,
            decode: d.node,
            decode_epoch,
            policy: format!("{}+{}", p.reason.name(), d.reason.name()),
            matched_pages: p.matched_pages,
            prompt_pages: keys.len(),
            alternatives,
        })
    }

    /// One attempt on the planned pair, up to its first event.
    async fn attempt(
        &self,
        req: &GenerateRequest,
        cache_salt: &str,
        plan: &Plan,
        route: proto::Route,
    ) -> Result<(PrefillClient<Channel>, backend::Opened), Failure> {
        let Some(client) = self.prefill_clients.get(&plan.prefill) else {
            return Err(Failure::Retry {
                why: format!("prefill node {} has no client", plan.prefill),
                culprit: WorkerRole::Prefill,
            });
        };
        let mut client = client.clone();
        let g = backend::generate_request(req.clone(), cache_salt.to_owned(), Some(route));
        match backend::open_remote(&mut client, g).await {
            Ok(o) if o.first.error.is_empty() => Ok((client, o)),
            Ok(o) => Err(Failure::Closed {
                why: o.first.error.clone(),
                error: ApiError::internal(
                    format!("prefill node: {}", o.first.error),
                    "backend_error",
                ),
            }),
            Err(s) => Err(self.classify(&s, plan)),
        }
    }

    /// A failed attempt: retryable only when nothing of it was posted (the nodes' own mark) or
    /// the call never reached the prefill node.
    fn classify(&self, s: &tonic::Status, plan: &Plan) -> Failure {
        use tonic::Code;
        let why = format!("{:?}: {}", s.code(), s.message());
        let posted_nothing = custody_runtime::disagg::is_nothing_posted(s);
        let never_sent = never_reached(s);
        if never_sent {
            self.observe_request_failure(WorkerRole::Prefill, plan.prefill);
        }
        let retryable_code = matches!(
            s.code(),
            Code::Unavailable | Code::ResourceExhausted | Code::FailedPrecondition | Code::Aborted
        );
        if (posted_nothing && retryable_code) || never_sent {
            let prefill_side = never_sent
                || s.message().contains("prefill node is draining")
                || s.message().contains("prefill engine");
            return Failure::Retry {
                why,
                culprit: if prefill_side {
                    WorkerRole::Prefill
                } else {
                    WorkerRole::Decode
                },
            };
        }
        Failure::Closed {
            error: backend::status_error(s),
            why,
        }
    }

    fn admitted(
        self: &Arc<Self>,
        request: u64,
        req: &GenerateRequest,
        plan: &Plan,
        route: &proto::Route,
        (client, opened): (PrefillClient<Channel>, backend::Opened),
    ) -> Admitted {
        let id = opened.first.request;
        self.record(
            ROUTE_EVENT,
            format!(
                "request={request} tenant={:?} transfer={} attempt={} prefill={} decode={} epoch={} outcome=admitted prefill_request={id}",
                req.tenant, route.transfer_id, route.attempt, plan.prefill, plan.decode, plan.decode_epoch
            ),
        );
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tenant = req.tenant.clone();
        let router = self.clone();
        let transfer = route.transfer_id;
        let (prefill, decode) = (plan.prefill, plan.decode);
        let events = backend::relay(
            client,
            opened,
            self.gauges.clone(),
            req.max_tokens,
            Some(tx),
        );
        tokio::spawn(async move {
            let (outcome, why) = match rx.await {
                Ok(RelayEnd::Finished { reason, generated }) => {
                    ("finished", format!("{reason} generated={generated}"))
                }
                Ok(RelayEnd::Failed(e)) => ("failed", e),
                Ok(RelayEnd::Ended) | Err(_) => ("ended", "by the server or its client".into()),
            };
            router.record(
                ROUTE_EVENT,
                format!(
                    "request={request} tenant={tenant:?} transfer={transfer} prefill={prefill} decode={decode} outcome={outcome} prefill_request={id} why={why:?}"
                ),
            );
        });
        (format!("req-{prefill}-{id}"), id, events)
    }

    /// The anomaly check of the front, on a fleet's first event.
    async fn check_anomaly(
        &self,
        node: u32,
        tenant: &str,
        prompt_tokens: usize,
        o: &backend::Opened,
    ) {
        Anomaly {
            check: self.check,
            node,
            tenant,
            prompt_tokens,
        }
        .check(o, &self.gauges, self.audit.as_ref())
        .await;
    }
}

/// What a router is made of besides its probe tasks.
struct Assembly {
    cfg: FleetSection,
    thresholds: HealthThresholds,
    policy: PolicyConfig,
    parts: RouterParts,
    prefill_clients: BTreeMap<NodeId, PrefillClient<Channel>>,
    gauges: Arc<EngineGauges>,
    check: PrefillCheck,
    seed: u64,
    transfer_base: u64,
}

impl Router {
    /// The registry from `a.cfg`, every node pending.
    fn assemble(a: Assembly) -> Self {
        let mut workers = BTreeMap::new();
        for (role, list) in [
            (WorkerRole::Prefill, &a.cfg.prefill),
            (WorkerRole::Decode, &a.cfg.decode),
        ] {
            for n in list {
                let w = Worker {
                    url: n.url.clone(),
                    health: Health::new(),
                    report: None,
                    routed_since_report: 0,
                    incompatible: None,
                };
                workers.insert((role, n.node), w);
            }
        }
        Self {
            node: a.parts.node,
            thresholds: a.thresholds,
            policy: a.policy,
            state: Mutex::new(State {
                workers,
                geometry: None,
                index: PrefixIndex::new(a.cfg.index_keys_per_node),
                rng: SplitMix64::new(a.seed),
                pairs: Vec::new(),
                pairs_at_ms: None,
            }),
            prefill_clients: a.prefill_clients,
            audit: a.parts.audit,
            namespaces: a.parts.namespaces,
            expected: Expected {
                fingerprint: a.parts.fingerprint,
                context_length: a.parts.context_length,
            },
            gauges: a.gauges,
            check: a.check,
            next_request: AtomicU64::new(1),
            transfer_base: a.transfer_base,
            next_transfer: AtomicU64::new(1),
            started: Instant::now(),
            stats: RouterStats::default(),
            cfg: a.cfg,
        }
    }
}

/// Nodes an attempt's failure ruled out for the request's next attempts.
#[derive(Debug, Default)]
struct Excluded {
    prefill: Vec<NodeId>,
    decode: Vec<NodeId>,
}

/// A chosen pair and why.
#[derive(Debug)]
struct Plan {
    prefill: NodeId,
    decode: NodeId,
    decode_epoch: u64,
    policy: String,
    matched_pages: usize,
    prompt_pages: usize,
    alternatives: String,
}

impl Plan {
    fn detail(&self, request: u64, tenant: &str, r: &proto::Route) -> String {
        format!(
            "request={request} tenant={tenant:?} transfer={} attempt={} prefill={} decode={} epoch={} outcome=chosen policy={} matched_pages={} prompt_pages={} alternatives={}",
            r.transfer_id,
            r.attempt,
            self.prefill,
            self.decode,
            self.decode_epoch,
            self.policy,
            self.matched_pages,
            self.prompt_pages,
            self.alternatives
        )
    }
}

/// How an attempt failed.
enum Failure {
    /// Nothing of it was posted: another pair may take the request.
    Retry { why: String, culprit: WorkerRole },
    /// Failed closed: the client gets `error`.
    Closed { why: String, error: ApiError },
}

/// A refusal before any attempt.
#[derive(Debug)]
struct Refusal {
    why: String,
    error: ApiError,
}

impl Refusal {
    fn unavailable(why: &str) -> Self {
        Self {
            why: why.into(),
            error: ApiError::unavailable(format!("router: {why}"), "backend_unavailable"),
        }
    }
    fn busy(why: &str) -> Self {
        Self {
            why: why.into(),
            error: ApiError::unavailable(format!("router: {why}"), "engine_queue_full"),
        }
    }
}

/// A prefill node, one of its live decode peers, and that peer's epoch as both agree.
#[derive(Clone, Copy, Debug)]
struct Pair {
    prefill: NodeId,
    decode: NodeId,
    epoch: u64,
}

/// The routable pairs now: both nodes ready (circuit closed), the prefill node's link to the
/// decode node connected, at the epoch the decode node itself reports.
fn routable_pairs(st: &State, now_ms: u64) -> Vec<Pair> {
    let mut out = Vec::new();
    for ((role, p), w) in &st.workers {
        if *role != WorkerRole::Prefill || !w.health.routable(now_ms) {
            continue;
        }
        let Some(rep) = &w.report else { continue };
        for link in rep.decode_peers.iter().filter(|l| l.connected) {
            let Some(d) = st.workers.get(&(WorkerRole::Decode, link.node_id)) else {
                continue;
            };
            let d_epoch = d.report.as_ref().map(|r| r.epoch);
            if d.health.routable(now_ms) && d_epoch == Some(link.epoch) {
                out.push(Pair {
                    prefill: *p,
                    decode: link.node_id,
                    epoch: link.epoch,
                });
            }
        }
    }
    out
}

/// The router's length and capacity check, before anything is reserved anywhere.
fn check_length(req: &GenerateRequest, g: &Geometry, st: &State) -> Result<(), Refusal> {
    let total = req.prompt.len() + req.max_tokens;
    if total as u64 > g.context_length {
        return Err(Refusal {
            why: format!("{total} tokens exceed the context of {}", g.context_length),
            error: ApiError::bad_request(format!(
                "This model's maximum context length is {} tokens. However, you requested {total} tokens ({} in the prompt, {} for the completion). Please reduce the length of the prompt or max_tokens. Nothing was computed or stored for this request.",
                g.context_length,
                req.prompt.len(),
                req.max_tokens
            ))
            .code("context_length_exceeded")
            .param("messages"),
        });
    }
    let pages = total.div_ceil(g.page_size.max(1) as usize) as u64;
    // Compatible decode nodes only (a failed one still counts: it may come back).
    let largest = st
        .workers
        .iter()
        .filter(|((r, _), w)| *r == WorkerRole::Decode && w.incompatible.is_none())
        .filter_map(|(_, w)| w.report.as_ref().map(|r| r.pool_pages))
        .max()
        .unwrap_or(0);
    if pages > largest {
        return Err(Refusal {
            why: format!("{pages} pages exceed every decode pool (largest {largest})"),
            error: ApiError::bad_request(format!(
                "the request needs {pages} KV pages; no decode node's pool holds that many ({largest}): reduce the prompt or max_tokens"
            ))
            .code("context_length_exceeded"),
        });
    }
    Ok(())
}

/// Why a node's report keeps it out of the fleet, if it does: another model than the router's,
/// or another geometry than the fleet's (the first compatible report sets the fleet's).
fn compatibility(
    expected: &Expected,
    geometry: &mut Option<Geometry>,
    rep: &proto::LoadReport,
    node: NodeId,
) -> Option<String> {
    let fingerprint = &expected.fingerprint;
    if !fingerprint.is_empty() && rep.model_fingerprint != *fingerprint {
        return Some(format!(
            "node {node} serves model {} but the router's is {fingerprint}",
            rep.model_fingerprint
        ));
    }
    if expected.context_length != 0 && rep.context_length != expected.context_length {
        return Some(format!(
            "node {node} states a context of {} tokens, the router's is {}",
            rep.context_length, expected.context_length
        ));
    }
    let g = Geometry::of(rep);
    match geometry {
        None => {
            *geometry = Some(g);
            None
        }
        Some(f) if *f == g => None,
        Some(f) => Some(format!("node {node} states {g:?}, the fleet's is {f:?}")),
    }
}

fn health_detail(role: WorkerRole, node: NodeId, url: &str, t: &Transition, why: &str) -> String {
    format!(
        "node={node} role={} url={url} from={} to={} reason={:?} detail={why:?}",
        role.name(),
        t.from.name(),
        t.to.name(),
        t.reason
    )
}

/// What the decision compared, for the route's row (JSON): how many candidates each side had,
/// the chosen prefill node's queue against the least loaded one's, and the two decode nodes the
/// power-of-two draw compared. (Not every candidate: at 64 × 64 that would be most of a
/// decision's cost and of the log.)
fn alternatives(
    prefills: &[PrefillCandidate],
    p: &custody_router::policy::PrefillChoice,
    decodes: &[DecodeCandidate],
    d: &custody_router::policy::DecodeChoice,
) -> String {
    let queued = |n: NodeId| {
        prefills
            .iter()
            .find(|c| c.node == n)
            .map_or(0, |c| c.queued_requests)
    };
    let least = prefills
        .iter()
        .min_by_key(|c| (c.queued_requests, std::cmp::Reverse(c.free_pages), c.node));
    let free = |n: NodeId| {
        decodes
            .iter()
            .find(|c| c.node == n)
            .map_or(0, |c| c.free_pages)
    };
    let other = d.other.map_or("null".to_owned(), |o| {
        format!("{{\"node\":{o},\"free_pages\":{}}}", free(o))
    });
    format!(
        "{{\"prefill\":{{\"candidates\":{},\"chosen\":{{\"node\":{},\"queued\":{}}},\"least_loaded\":{{\"node\":{},\"queued\":{}}}}},\"decode\":{{\"candidates\":{},\"chosen\":{{\"node\":{},\"free_pages\":{}}},\"other\":{other}}}}}",
        prefills.len(),
        p.node,
        queued(p.node),
        least.map_or(0, |c| c.node),
        least.map_or(0, |c| c.queued_requests),
        decodes.len(),
        d.node,
        free(d.node),
    )
}

/// Whether a failed call never reached the node: the connection could not be made, so the node
/// cannot have started (let alone posted) anything of it.
fn never_reached(s: &tonic::Status) -> bool {
    use std::error::Error as _;
    if s.code() != tonic::Code::Unavailable {
        return false;
    }
    let mut src = s.source();
    // Bounded: error chains are short; at most 16 links looked at.
    for _ in 0..16 {
        let Some(e) = src else { break };
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::HostUnreachable
                    | std::io::ErrorKind::NetworkUnreachable
                    | std::io::ErrorKind::TimedOut
            )
        {
            return true;
        }
        if e.to_string().contains("tcp connect error") {
            return true;
        }
        src = e.source();
    }
    false
}

fn lazy_channel(
    security: &Security,
    url: &str,
    id: NodeIdentity,
) -> Result<Channel, custody_runtime::disagg::tls::ChannelError> {
    match security {
        Security::Tls(_) => security.channel_lazy(url, id),
        Security::InsecureLoopback => {
            security.check_url(url)?;
            Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
                .connect_timeout(Duration::from_secs(2))
                .connect_lazy())
        }
    }
}

async fn probe_loop(
    router: std::sync::Weak<Router>,
    role: WorkerRole,
    node: NodeId,
    mut client: FleetClient<Channel>,
) {
    let (interval, timeout) = match router.upgrade() {
        Some(r) => (
            Duration::from_millis(r.cfg.probe_interval_ms),
            Duration::from_millis(r.cfg.probe_timeout_ms),
        ),
        None => return,
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let r = match tokio::time::timeout(timeout, client.load(proto::LoadRequest {})).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(format!("{:?}: {}", s.code(), s.message())),
            Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
        };
        let Some(router) = router.upgrade() else {
            return;
        };
        router.observe_probe(role, node, r);
    }
}

/// A synthetic load report: a ready node of the fleet's geometry (tests and the benchmark).
fn synthetic_report(role: WorkerRole, node: NodeId, decodes: &[NodeId]) -> proto::LoadReport {
    proto::LoadReport {
        node_id: node,
        role: role.name().into(),
        epoch: u64::from(node) * 1000 + 1,
        model_fingerprint: String::new(),
        page_size: 16,
        context_length: 4096,
        pool_pages: 4096,
        free_pages: 4096,
        kv_dtype: "f16".into(),
        n_layers: 30,
        kv_dim: 192,
        decode_peers: decodes
            .iter()
            .map(|&d| proto::PeerLink {
                node_id: d,
                epoch: u64::from(d) * 1000 + 1,
                connected: true,
            })
            .collect(),
        ..Default::default()
    }
}

impl Router {
    /// A router over `prefill` × `decode` nodes that exist only as synthetic reports (every
    /// node ready, every prefill node paired with every decode node): no channel, no probe, no
    /// log. For the routing benchmark and the tests: the decisions are the real `plan`'s.
    pub fn offline(prefill: u32, decode: u32) -> Arc<Self> {
        let cfg = FleetSection {
            prefill: (1..=prefill)
                .map(|n| crate::config::FleetNode {
                    node: n,
                    url: format!("http://p{n}"),
                })
                .collect(),
            decode: (1..=decode)
                .map(|n| crate::config::FleetNode {
                    node: prefill + n,
                    url: format!("http://d{n}"),
                })
                .collect(),
            seed: 1,
            ..FleetSection::default()
        };
        let router = Arc::new(Self::assemble(Assembly {
            cfg,
            thresholds: HealthThresholds::default(),
            policy: PolicyConfig::default(),
            parts: RouterParts {
                node: 0,
                audit: None,
                namespaces: None,
                fingerprint: String::new(),
                context_length: 0,
            },
            prefill_clients: BTreeMap::new(),
            gauges: Arc::default(),
            // Off: no first event is ever checked here.
            check: PrefillCheck {
                max_plausible_tok_s: 0.0,
                min_tokens: 0,
            },
            seed: 1,
            transfer_base: 0,
        }));
        router.report_all();
        router.report_all();
        router
    }

    /// Every node reports (synthetic, ready, idle).
    fn report_all(&self) {
        let decodes: Vec<NodeId> = self.cfg.decode.iter().map(|n| n.node).collect();
        for n in &self.cfg.prefill {
            let r = synthetic_report(WorkerRole::Prefill, n.node, &decodes);
            self.observe_probe(WorkerRole::Prefill, n.node, Ok(r));
        }
        for n in &self.cfg.decode {
            let r = synthetic_report(WorkerRole::Decode, n.node, &[]);
            self.observe_probe(WorkerRole::Decode, n.node, Ok(r));
        }
    }
}

/// What one routing decision costs (`custody bench-router`).
#[derive(Clone, Copy, Debug)]
pub struct RoutingCost {
    pub prefill_nodes: u32,
    pub decode_nodes: u32,
    pub prompt_pages: usize,
    pub decisions: u32,
    pub ns_per_decision: f64,
    pub decisions_per_s: f64,
}

/// Time `decisions` routing decisions — the router's own `plan` (registry lock, length and
/// capacity checks, cache-aware prefill choice over `prompt_pages` chain keys, power-of-two
/// decode choice, the alternatives' JSON for the log) and the index update an admission makes —
/// on an offline router of `prefill` × `decode` ready nodes. Reports arrive every 64 decisions
/// (as a 250 ms probe interval would at ~250 decisions/s per node).
pub fn bench_routing(
    prefill: u32,
    decode: u32,
    prompt_pages: usize,
    decisions: u32,
) -> RoutingCost {
    let router = Router::offline(prefill, decode);
    let req = GenerateRequest {
        decoding: Default::default(),
        prompt: vec![1; prompt_pages * 16 + 5],
        max_tokens: 64,
        sampling: Default::default(),
        stop_ids: vec![],
        tenant: "bench".into(),
        cache: None,
    };
    // Chain keys: 16 distinct prefixes, so that affinity has something to find.
    let keys_of = |i: u32| -> Vec<ChainKey> {
        (0..prompt_pages)
            .map(|p| {
                let mut k = [0u8; 32];
                k[..4].copy_from_slice(&(i % 16).to_le_bytes());
                k[4..12].copy_from_slice(&(p as u64).to_le_bytes());
                k
            })
            .collect()
    };
    let excluded = Excluded::default();
    let t0 = Instant::now();
    for i in 0..decisions {
        if i % 64 == 0 {
            router.report_all();
        }
        let keys = keys_of(i);
        let plan = router
            .plan(&req, &keys, &excluded)
            .unwrap_or_else(|e| panic!("the offline fleet routes every request: {}", e.why));
        let _route = router.mint(&plan, 1);
        router.lock().index.record(plan.prefill, &keys);
    }
    let s = t0.elapsed().as_secs_f64();
    RoutingCost {
        prefill_nodes: prefill,
        decode_nodes: decode,
        prompt_pages,
        decisions,
        ns_per_decision: s * 1e9 / f64::from(decisions.max(1)),
        decisions_per_s: f64::from(decisions) / s.max(1e-12),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: usize, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            decoding: Default::default(),
            prompt: vec![1; prompt],
            max_tokens,
            sampling: Default::default(),
            stop_ids: vec![],
            tenant: "t".into(),
            cache: None,
        }
    }

    /// Over-length and over-capacity requests are refused at the router, before any attempt
    /// (the prefill node's admission checks again).
    #[test]
    fn length_and_capacity_are_checked_before_any_attempt() {
        let r = Router::offline(2, 2);
        let none = Excluded::default();
        assert!(r.plan(&req(100, 16), &[], &none).is_ok());
        let e = r
            .plan(&req(4000, 200), &[], &none)
            .expect_err("over the context");
        assert!(e.why.contains("exceed the context"), "{}", e.why);
        // Within the context but more pages than any decode pool holds.
        {
            let mut st = r.lock();
            for ((role, _), w) in st.workers.iter_mut() {
                if *role == WorkerRole::Decode
                    && let Some(rep) = &mut w.report
                {
                    rep.pool_pages = 8;
                }
            }
        }
        let e = r
            .plan(&req(200, 16), &[], &none)
            .expect_err("over every pool");
        assert!(e.why.contains("every decode pool"), "{}", e.why);
    }

    /// A decode node whose reported epoch differs from the prefill node's link to it (it
    /// restarted, the prefill node has not re-paired yet) is not routable: no route names an
    /// epoch the decode node is not at.
    #[test]
    fn a_restarted_decode_node_is_routed_to_only_once_re_paired() {
        let r = Router::offline(1, 2);
        let none = Excluded::default();
        {
            let mut st = r.lock();
            let d = st
                .workers
                .get_mut(&(WorkerRole::Decode, 2))
                .expect("decode 2");
            d.report.as_mut().expect("report").epoch = 777;
        }
        for _ in 0..32 {
            let p = r.plan(&req(40, 8), &[], &none).expect("routed");
            assert_eq!(p.decode, 3, "only the decode node at the linked epoch");
        }
        let pairs = routable_pairs(&r.lock(), r.now_ms());
        assert!(pairs.iter().all(|p| p.decode != 2));
    }

    /// Power of two choices on free pages, counting what this router sent since the reports:
    /// a burst between two reports alternates rather than piling onto one node.
    #[test]
    fn a_burst_between_reports_is_spread_by_what_the_router_sent() {
        let r = Router::offline(1, 2);
        let none = Excluded::default();
        let mut per = BTreeMap::new();
        for _ in 0..20 {
            let p = r.plan(&req(1000, 24), &[], &none).expect("routed");
            *per.entry(p.decode).or_insert(0u32) += 1;
        }
        assert_eq!(per.len(), 2, "{per:?}");
        let (a, b) = (per[&2], per[&3]);
        assert!(a.abs_diff(b) <= 2, "{per:?}");
    }

    /// Excluded nodes (an attempt's culprit) are not chosen again for the request.
    #[test]
    fn a_retry_avoids_the_failed_node() {
        let r = Router::offline(2, 2);
        let ex = Excluded {
            prefill: vec![1],
            decode: vec![3],
        };
        for _ in 0..10 {
            let p = r.plan(&req(40, 8), &[], &ex).expect("routed");
            assert_eq!((p.prefill, p.decode), (2, 4));
        }
        let all = Excluded {
            prefill: vec![1, 2],
            decode: vec![],
        };
        assert!(r.plan(&req(40, 8), &[], &all).is_err());
    }

    /// Retried only when nothing of the attempt was posted (the node's mark) with a retryable
    /// code; otherwise failed closed.
    #[test]
    fn only_failures_before_any_write_are_retried() {
        let r = Router::offline(1, 1);
        let plan = r
            .plan(&req(40, 8), &[], &Excluded::default())
            .expect("plan");
        let marked = custody_runtime::disagg::nothing_posted(tonic::Status::unavailable(
            "decode node 2 is at epoch 5, the route names epoch 4",
        ));
        assert!(matches!(
            r.classify(&marked, &plan),
            Failure::Retry {
                culprit: WorkerRole::Decode,
                ..
            }
        ));
        let drained = custody_runtime::disagg::nothing_posted(tonic::Status::unavailable(
            "this prefill node is draining",
        ));
        assert!(matches!(
            r.classify(&drained, &plan),
            Failure::Retry {
                culprit: WorkerRole::Prefill,
                ..
            }
        ));
        let after_writes = tonic::Status::unavailable("KV transfer failed: connection lost");
        assert!(matches!(
            r.classify(&after_writes, &plan),
            Failure::Closed { .. }
        ));
        let client_error = custody_runtime::disagg::nothing_posted(
            tonic::Status::invalid_argument("prompt exceeds the context length"),
        );
        assert!(matches!(
            r.classify(&client_error, &plan),
            Failure::Closed { .. }
        ));
    }

    /// A node stating another geometry than the fleet's never becomes ready.
    #[test]
    fn an_incompatible_node_is_held_out() {
        let r = Router::offline(1, 3);
        let mut bad = synthetic_report(WorkerRole::Decode, 3, &[]);
        bad.page_size = 32;
        // Another KV cache type: its pages' bytes are another format.
        let mut other_kv = synthetic_report(WorkerRole::Decode, 4, &[]);
        other_kv.kv_dtype = "q8_0".into();
        for _ in 0..4 {
            let good = synthetic_report(WorkerRole::Decode, 2, &[]);
            r.observe_probe(WorkerRole::Decode, 2, Ok(good));
            r.observe_probe(WorkerRole::Decode, 3, Ok(bad.clone()));
            r.observe_probe(WorkerRole::Decode, 4, Ok(other_kv.clone()));
        }
        let states = r.health_states();
        let ready = |node| {
            states.iter().any(|(role, n, s)| {
                *role == WorkerRole::Decode && *n == node && *s == HealthState::Ready
            })
        };
        assert!(ready(2), "the control: a compatible node becomes ready");
        for node in [3, 4] {
            let s = states
                .iter()
                .find(|(role, n, _)| *role == WorkerRole::Decode && *n == node)
                .expect("decode node");
            assert_ne!(s.2, HealthState::Ready, "decode {node}");
        }
    }
}

//! The routes and the life of one generation request.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::config::ServeSection;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use custody_audit::RequestKind;
use custody_runtime::decoding::{Decoding, LogitBias, TokenLogprobs};
use custody_runtime::engine::{FinishReason, GenerateRequest};
use custody_runtime::grammar::Grammars;
use custody_runtime::tokenizer::{StreamDecoder, TokenizerError};
use custody_runtime::tools::{ParsedCall, ToolDef, ToolError, ToolFormat, tool_grammar};
use custody_runtime::{SamplingParams, Tokenizer};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::backend::Backend;
use crate::engine_thread::{ClientEnd, Events, Out};
use crate::error::ApiError;
use crate::metrics::{AuditStats, Metrics};
use crate::openai::{self, Params, Prompt, StopText};
use crate::tenants::{Tenant, Tenants};

/// Shared by every handler.
#[derive(Debug)]
pub(crate) struct AppState {
    pub backend: Backend,
    pub tokenizer: Arc<Tokenizer>,
    pub tenants: Tenants,
    pub metrics: Arc<Metrics>,
    pub cfg: ServeSection,
    pub model_name: String,
    pub context_length: usize,
    pub node: u32,
    pub audit: Option<Arc<dyn AuditStats>>,
    /// Set on SIGINT/SIGTERM: new work is refused (503) while in-flight requests finish.
    pub draining: AtomicBool,
    pub created_unix_s: u64,
    /// Ids for requests refused before they reach the engine (never in the audit log).
    pub refused_seq: AtomicU64,
    /// The prefix cache's namespaces (`None`: nothing is cached).
    /// (Derived from the authenticated tenant: `Namespaces::scope`.)
    pub prefix: Option<Arc<custody_runtime::prefix_cache::Namespaces>>,
    /// The constraint compiler over this model's vocabulary, or why there is none.
    pub grammars: Result<Arc<Grammars>, String>,
    /// Receipts and tree proofs (`/v1/audit/...`).
    pub proofs: Option<Arc<dyn crate::receipts::AuditProofs>>,
}

pub(crate) fn router(st: Arc<AppState>) -> Router {
    let limit = st.cfg.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route(
            "/v1/audit/receipt/{request_id}",
            get(crate::receipts::receipt),
        )
        .route("/v1/audit/checkpoint", get(crate::receipts::checkpoint))
        .route("/v1/audit/proof/inclusion", get(crate::receipts::inclusion))
        .route(
            "/v1/audit/proof/consistency",
            get(crate::receipts::consistency),
        )
        .route("/health", get(health))
        .route("/health/live", get(live))
        .route("/health/ready", get(health))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(st)
}

/// The operator's listener (`[serve] metrics_listen`): `/metrics` — every tenant's request and
/// token counts and prefix-cache hits, a side channel were it on the tenants' port — and the
/// health endpoints.
pub(crate) fn operator_router(st: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/health/live", get(live))
        .route("/health/ready", get(health))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(st)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Completions => "completions",
        }
    }
}

async fn chat(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(st, headers, body, Endpoint::Chat).await
}

async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(st, headers, body, Endpoint::Completions).await
}

async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.tenants.authenticate(headers.get(header::AUTHORIZATION)) {
        return e.into_response();
    }
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": st.model_name,
                "object": "model",
                "created": st.created_unix_s,
                "owned_by": "custody",
                "context_length": st.context_length,
            }]
        }),
    )
}

/// Readiness (`/health`, `/health/ready`): 200 while serving, 503 while draining, when the
/// audit log failed (the node serves nothing then), or — a router — while no prefill/decode
/// pair is routable. A server run without an audit log (`--no-audit`) is ready but says
/// `"status": "degraded"`, `"degraded": ["audit_disabled"]`.
async fn health(State(st): State<Arc<AppState>>) -> Response {
    let status = readiness(&st);
    let code = if matches!(status, "ok" | "degraded") {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = json!({ "status": status, "model": st.model_name });
    if status == "degraded" {
        body["degraded"] = json!(["audit_disabled"]);
    }
    json_response(code, &body)
}

/// The readiness status: what stops the server serving first, then what it serves without.
fn readiness(st: &AppState) -> &'static str {
    let no_pair = match &st.backend {
        crate::backend::Backend::Fleet(r) => r.ready().is_err(),
        _ => false,
    };
    if st.backend.gauges().audit_failed.load(Ordering::Relaxed) {
        "audit_failed"
    } else if st.draining.load(Ordering::Relaxed) {
        "draining"
    } else if st.audit.as_ref().is_some_and(|a| a.cosignatures_missing()) {
        "audit_uncosigned"
    } else if no_pair {
        "no_routable_pair"
    } else if st.metrics.audit_disabled.load(Ordering::Relaxed) {
        "degraded"
    } else {
        "ok"
    }
}

/// Liveness: the process answers HTTP (Kubernetes restarts it when this fails).
async fn live() -> Response {
    json_response(StatusCode::OK, &json!({ "status": "live" }))
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let mut body = st.metrics.render(st.backend.gauges(), st.audit.as_deref());
    if let crate::backend::Backend::Fleet(r) = &st.backend {
        body.push_str(&r.metrics_text());
    }
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        body,
    )
        .into_response()
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        v.to_string(),
    )
        .into_response()
}

fn unix_now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

// The request id returned in `x-request-id`. `req-<node>-<n>`: `n` is the engine's request id
// (of the prefill node when fronting a pair), the `request_id` column of every audit table on
// node `<node>` (a rejection at admission is recorded under it too). `refused-<node>-<n>`:
// refused before admission (authentication, malformed body, tenant limits, draining, audit
// back-pressure), so no page was touched and the audit log has nothing under it; the server's
// log does.
async fn generate(
    st: Arc<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    ep: Endpoint,
) -> Response {
    let t0 = Instant::now();
    let mut tenant_label = "_unauthenticated".to_owned();
    let mut rid: Option<String> = None;
    let result = admit_and_run(&st, &headers, body, ep, t0, &mut tenant_label, &mut rid).await;
    let rid = rid.unwrap_or_else(|| {
        format!(
            "refused-{}-{}",
            st.node,
            st.refused_seq.fetch_add(1, Ordering::Relaxed) + 1
        )
    });
    let mut resp = match result {
        Ok(r) => r,
        Err(e) => {
            tracing::info!(
                request_id = %rid,
                tenant = %tenant_label,
                endpoint = ep.name(),
                status = e.status.as_u16(),
                error = %e.message,
                "request refused"
            );
            st.metrics
                .request(&tenant_label, ep.name(), e.status.as_u16());
            e.into_response()
        }
    };
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    // Where the tenant fetches this request's receipt (its records' proofs, once sealed).
    if st.proofs.is_some()
        && rid.starts_with("req-")
        && let Ok(v) = HeaderValue::from_str(&format!("/v1/audit/receipt/{rid}"))
    {
        resp.headers_mut().insert("x-custody-receipt", v);
    }
    resp
}

/// Everything up to the engine's answer; then the response (streamed or whole). Errors
/// returned here are answered by `generate`, which also counts them.
async fn admit_and_run(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    ep: Endpoint,
    t0: Instant,
    tenant_label: &mut String,
    rid: &mut Option<String>,
) -> Result<Response, ApiError> {
    let tenant = st
        .tenants
        .authenticate(headers.get(header::AUTHORIZATION))?;
    tenant_label.clone_from(&tenant.id.to_string());
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                ..ApiError::bad_request(format!(
                    "request body larger than {} bytes (serve.max_body_bytes)",
                    st.cfg.max_body_bytes
                ))
            }
            .code("body_too_large")
        } else {
            ApiError::bad_request(format!("could not read the request body: {e}"))
        }
    })?;
    let (prompt, params) = match ep {
        Endpoint::Chat => openai::parse_chat(&body)?,
        Endpoint::Completions => openai::parse_completion(&body)?,
    };
    if let Some(m) = &params.model
        && *m != st.model_name
    {
        return Err(ApiError::not_found(format!(
            "the model {m:?} does not exist on this server; it serves {:?} (GET /v1/models)",
            st.model_name
        ))
        .code("model_not_found")
        .param("model"));
    }
    if st.draining.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable(
            "the server is shutting down; retry on another node",
            "shutting_down",
        ));
    }
    if st.backend.gauges().audit_failed.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable(
            "the audit log is unavailable, so this node serves nothing (fail-closed)",
            "audit_unavailable",
        ));
    }
    if st.audit.as_ref().is_some_and(|a| a.cosignatures_missing()) {
        return Err(ApiError::unavailable(
            "this node's audit log is not cosigned by its witnesses ([audit] require_cosignatures), so it takes no new work (fail-closed)",
            "audit_uncosigned",
        ));
    }
    if let Some(a) = &st.audit {
        let cap = a.queue_capacity().max(1) as f64;
        if a.queue_depth() as f64 > cap * st.cfg.audit_high_water {
            st.metrics
                .audit_backpressure_rejections_total
                .fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::unavailable(
                "the audit log cannot keep up with the load right now; retry shortly",
                "audit_backpressure",
            ));
        }
    }
    let ids = tokenize(st, prompt, &params.tools.tools).await?;
    let decoding = decoding(st, &params).await?;
    let max_tokens = params.max_tokens.unwrap_or_else(|| {
        // Default: the configured default, lowered to what the context leaves (at least 1, so
        // that an over-long prompt is still refused by admission with the right message).
        st.cfg
            .default_max_tokens
            .min(st.context_length.saturating_sub(ids.len()))
            .max(1)
    });
    if params.n > st.cfg.max_n {
        return Err(ApiError::bad_request(format!(
            "n is {}; this server answers at most {} choices (serve.max_n)",
            params.n, st.cfg.max_n
        ))
        .param("n"));
    }
    let permit = Arc::new(tenant.try_acquire()?);
    // A request longer than the context goes to admission uncharged: it is refused there with
    // the 400 that says why (and recorded), not with a 429 about the tenant's budget.
    let fits = ids.len().saturating_add(max_tokens) <= st.context_length;
    let charged = if fits {
        (ids.len() as u64).saturating_add((max_tokens as u64).saturating_mul(params.n as u64))
    } else {
        0
    };
    tenant.charge(charged)?;
    let refund = Arc::new(Refund {
        tenant: tenant.clone(),
        charged,
        used: AtomicU64::new(if fits { ids.len() as u64 } else { 0 }),
    });
    // From the authenticated tenant: a client's salt only narrows it.
    let cache = st
        .prefix
        .as_ref()
        .map(|p| p.scope(&tenant.id, params.cache_salt.as_deref(), &ids));
    let seed = params.seed.unwrap_or_else(random_seed);
    let req = GenerateRequest {
        decoding,
        prompt: ids,
        max_tokens,
        sampling: SamplingParams {
            temperature: params.temperature,
            top_k: 0,
            top_p: params.top_p,
            seed,
        },
        stop_ids: st.tokenizer.stop_ids.clone(),
        tenant: tenant.id.to_string(),
        cache,
    };
    let prompt_tokens = req.prompt.len();
    let siblings = req.clone();
    let (request_id, id, events) = match st
        .backend
        .submit(req, st.node, params.cache_salt.as_deref())
        .await
    {
        Ok(a) => a,
        Err((r, mut e)) => {
            *rid = r;
            if e.param.as_deref() == Some("messages") && ep == Endpoint::Completions {
                e.param = Some("prompt".into());
            }
            return Err(e);
        }
    };
    *rid = Some(request_id);
    tracing::debug!(request_id = rid.as_deref().unwrap_or(""), tenant = %tenant.id, prompt_tokens, max_tokens, n = params.n, "admitted");
    st.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
    let n = params.n;
    let mut first = Run {
        st: st.clone(),
        id,
        rid: rid.clone().unwrap_or_default(),
        ep,
        tenant,
        _permit: permit,
        refund,
        choice: 0,
        pending: None,
        events,
        delivered_tokens: 0,
        t0,
        prompt_tokens,
        params,
        finished: false,
        pending_end: None,
        created: unix_now_s(),
        cached_tokens: 0,
        promises: Vec::new(),
    };
    let mut runs = Vec::with_capacity(n);
    if n > 1 {
        // The other choices are admitted once choice 0 has computed the prompt: its full
        // pages are then in the prefix cache, and theirs are hits on them (read-only, through
        // the namespace's tag; recorded as `hit` rows naming choice 0 as the writer).
        first.pending = first.events.rx.recv().await;
        for choice in 1..n {
            let mut req = siblings.clone();
            req.sampling.seed = choice_seed(seed, choice);
            runs.push(first.sibling(choice, req).await?);
        }
    }
    runs.insert(0, first);
    if runs[0].params.stream {
        Ok(stream(runs))
    } else {
        whole(runs).await
    }
}

/// Choice `i`'s seed: the request's for choice 0 (so `n = 1` and choice 0 of `n > 1` agree),
/// an independent stream (SplitMix64's finalizer over seed and index) for the others.
fn choice_seed(seed: u64, i: usize) -> u64 {
    if i == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Run {
    /// Admit choice `choice` of this request (`req`: the request with its seed).
    async fn sibling(&self, choice: usize, req: GenerateRequest) -> Result<Run, ApiError> {
        let (rid, id, events) = self
            .st
            .backend
            .submit(req, self.st.node, self.params.cache_salt.as_deref())
            .await
            .map_err(|(_, e)| e)?;
        self.st.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(Run {
            st: self.st.clone(),
            id,
            rid,
            ep: self.ep,
            tenant: self.tenant.clone(),
            _permit: self._permit.clone(),
            refund: self.refund.clone(),
            choice,
            pending: None,
            events,
            delivered_tokens: 0,
            t0: self.t0,
            prompt_tokens: self.prompt_tokens,
            params: self.params.clone(),
            finished: false,
            pending_end: None,
            created: self.created,
            cached_tokens: 0,
            promises: Vec::new(),
        })
    }
}

/// The request's decoding options, checked against the vocabulary, its constraint compiled
/// off the async workers (a pair's or fleet's nodes compile it again where they sample: it
/// travels as its kind and text).
async fn decoding(st: &Arc<AppState>, p: &Params) -> Result<Decoding, ApiError> {
    let mut d = Decoding {
        logit_bias: p
            .logit_bias
            .iter()
            .map(|&(token, bias)| LogitBias { token, bias })
            .collect(),
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logprobs: p.logprobs,
        constraint: None,
        n: u32::try_from(p.n).unwrap_or(u32::MAX),
    };
    d.validate(st.tokenizer.vocab_size())
        .map_err(|e| ApiError::bad_request(e.to_string()).param(e.param()))?;
    let (spec, param) = match (&p.tools.choice, p.constraint.clone()) {
        (Some(choice), _) => {
            let format = st.tokenizer.tool_format().ok_or_else(|| {
                ApiError::bad_request(ToolError::NoFormat.to_string()).param("tools")
            })?;
            let tok = &st.tokenizer;
            let spec = tool_grammar(format, &p.tools.tools, choice, p.tools.parallel, |t| {
                tok.special_token_id(t)
            })
            .map_err(|e| ApiError::bad_request(e.to_string()).param("tool_choice"))?;
            (spec, "tools")
        }
        (None, Some(spec)) => (spec, p.constraint_param),
        (None, None) => return Ok(d),
    };
    let grammars = st.grammars.clone().map_err(|why| {
        ApiError::bad_request(format!("constrained decoding is unavailable: {why}")).param(param)
    })?;
    // Compiling a schema can take a while: the blocking pool, never an async worker.
    let compiled = tokio::task::spawn_blocking(move || grammars.compile(spec))
        .await
        .map_err(|e| {
            ApiError::internal(format!("constraint compiler task failed: {e}"), "internal")
        })?
        .map_err(|e| ApiError::bad_request(e.to_string()).param(param))?;
    d.constraint = Some(compiled);
    Ok(d)
}

fn random_seed() -> u64 {
    // Not cryptographic: a sampling seed only has to differ between requests.
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    static N: AtomicU64 = AtomicU64::new(0);
    t ^ N
        .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
        .rotate_left(17)
}

async fn tokenize(
    st: &Arc<AppState>,
    prompt: Prompt,
    tools: &[ToolDef],
) -> Result<Vec<u32>, ApiError> {
    let tok = st.tokenizer.clone();
    let tools = tools.to_vec();
    // Tokenizing up to `max_body_bytes` of text takes milliseconds: off the async workers, so
    // it never delays other requests' streams.
    let ids = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        match prompt {
            Prompt::Tokens(ids) => Ok(ids),
            Prompt::Text(t) => tok
                .encode(&t, false)
                .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}"))),
            Prompt::Chat(msgs) => tok.encode_chat_tools(&msgs, &tools).map_err(|e| match e {
                TokenizerError::Tools(e) => ApiError::bad_request(e.to_string()).param("tools"),
                e => ApiError::bad_request(format!("cannot apply the chat template: {e}")),
            }),
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}"), "internal"))??;
    if ids.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty").param("prompt"));
    }
    Ok(ids)
}

/// Gives back a tenant's unused token budget when the request ends, however it ends.
#[derive(Debug)]
struct Refund {
    tenant: Arc<Tenant>,
    charged: u64,
    /// Prompt tokens and every choice's delivered tokens (choices share one refund).
    used: AtomicU64,
}

impl Drop for Refund {
    fn drop(&mut self) {
        self.tenant
            .refund(self.charged.saturating_sub(*self.used.get_mut()));
    }
}

/// One admitted request until its end. Dropping it before the end (client gone) aborts the
/// request in the engine, which releases its pages.
#[derive(Debug)]
struct Run {
    st: Arc<AppState>,
    id: u64,
    rid: String,
    ep: Endpoint,
    tenant: Arc<Tenant>,
    /// The tenant's concurrency slot, shared by the request's choices.
    _permit: Arc<tokio::sync::OwnedSemaphorePermit>,
    refund: Arc<Refund>,
    /// Which choice (`index`) this run is.
    choice: usize,
    /// An event taken before the run was read (choice 0 waits for its first token before the
    /// other choices are admitted), handed out first.
    pending: Option<Out>,
    events: Events,
    /// Output tokens taken from the engine and handed on to the client so far.
    delivered_tokens: usize,
    t0: Instant,
    prompt_tokens: usize,
    params: Params,
    finished: bool,
    /// The end, once decided, if its last text has not been handed out yet.
    pending_end: Option<&'static str>,
    created: u64,
    /// Prompt tokens served from the prefix cache (known at the end).
    cached_tokens: usize,
    /// A pair's nodes' signed promises of the request's records (from its final event).
    promises: Vec<crate::receipts::NodePromise>,
}

impl Drop for Run {
    fn drop(&mut self) {
        self.st.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        if !self.finished {
            self.events.end.set(ClientEnd {
                kind: RequestKind::Aborted {
                    reason: "client_disconnected".into(),
                },
                delivered_tokens: self.delivered_tokens,
            });
            self.st.backend.end(self.id);
            tracing::info!(request_id = %self.rid, tenant = %self.tenant.id, "client went away: request aborted");
            self.st
                .metrics
                .request(&self.tenant.id, self.ep.name(), 499);
        }
    }
}

/// How a generation ended, as the client sees it.
enum End {
    Done(&'static str),
    Error(ApiError),
}

/// Pulls engine events and turns them into text pieces (stop sequences applied).
struct Decoder {
    dec: StreamDecoder,
    stop: StopText,
    tokens: Vec<u32>,
    /// Each output token's log-probabilities, when asked for (in `tokens` order).
    logprobs: Vec<(u32, Box<TokenLogprobs>)>,
    /// Entries of `logprobs` already sent in a stream chunk.
    logprobs_sent: usize,
    /// Characters of those entries' tokens (the next one's `text_offset`).
    logprobs_chars: usize,
    last_token_at: Option<Instant>,
}

impl Run {
    fn id_string(&self) -> String {
        match self.ep {
            Endpoint::Chat => format!("chatcmpl-{}", self.rid),
            Endpoint::Completions => format!("cmpl-{}", self.rid),
        }
    }

    /// Next piece of text, or the end.
    async fn next(&mut self, d: &mut Decoder) -> Result<String, End> {
        loop {
            let ev = match self.pending.take() {
                Some(ev) => Some(ev),
                None => self.events.rx.recv().await,
            };
            let Some(ev) = ev else {
                self.finished = true;
                return Err(End::Error(ApiError::internal(
                    "the engine dropped the request",
                    "engine_stopped",
                )));
            };
            match ev {
                Out::Token { token: t, logprobs } => {
                    if let Some(lp) = logprobs {
                        d.logprobs.push((t, lp));
                    }
                    let now = Instant::now();
                    match d.last_token_at {
                        None => self.st.metrics.time_to_first_token.observe(now - self.t0),
                        Some(prev) => self.st.metrics.inter_token.observe(now - prev),
                    }
                    d.last_token_at = Some(now);
                    d.tokens.push(t);
                    self.refund.used.fetch_add(1, Ordering::Relaxed);
                    self.delivered_tokens += 1;
                    let piece = d.dec.push(&self.st.tokenizer, t).map_err(|e| {
                        End::Error(ApiError::internal(
                            format!("cannot decode token {t}: {e}"),
                            "internal",
                        ))
                    })?;
                    let (out, stopped) = d.stop.push(&piece);
                    if stopped {
                        // The engine does not know text-level stops: end it here, recorded as
                        // the client sees it (finished, `stop`, the tokens in its `usage`).
                        self.events.end.set(ClientEnd {
                            kind: RequestKind::Finished {
                                reason: "stop".into(),
                            },
                            delivered_tokens: d.tokens.len(),
                        });
                        self.st.backend.end(self.id);
                        if self.events.told.is_some() {
                            // A pair's: closing the channel has the relay tell its nodes now
                            // (they record the end, and can promise its records).
                            self.events.rx.close();
                        }
                        self.finished = true;
                        if !out.is_empty() {
                            // The caller emits this, then sees the end on the next call.
                            self.pending_end = Some("stop");
                            return Ok(out);
                        }
                        return Err(End::Done("stop"));
                    }
                    if !out.is_empty() {
                        return Ok(out);
                    }
                }
                Out::Finished {
                    reason,
                    cached_tokens,
                    promises,
                    ..
                } => {
                    self.finished = true;
                    self.cached_tokens = cached_tokens;
                    self.promises = promises;
                    let reason = match reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    };
                    let tail = d.stop.finish();
                    if !tail.is_empty() {
                        self.pending_end = Some(reason);
                        return Ok(tail);
                    }
                    return Err(End::Done(reason));
                }
                Out::Failed(msg) => {
                    self.finished = true;
                    return Err(End::Error(ApiError::internal(
                        format!(
                            "the request failed the KV integrity check and was stopped without further output: {msg}"
                        ),
                        "integrity_violation",
                    )));
                }
                Out::Aborted(msg) => {
                    self.finished = true;
                    return Err(End::Error(ApiError::unavailable(
                        format!("the request was aborted: {msg}"),
                        "aborted",
                    )));
                }
            }
        }
    }

    /// The usage object. `prompt_tokens_details.cached_tokens` is the caller's own: prompt
    /// tokens taken from its own namespaces (its tenant's, or a public scope's) — the answer
    /// goes only to the tenant that sent the request.
    /// `completion_tokens`: over every choice (the prompt counts once).
    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    fn done(&self, status: u16, finish: &str, completion_tokens: usize) {
        let m = &self.st.metrics;
        m.request(&self.tenant.id, self.ep.name(), status);
        m.tokens(&self.tenant.id, self.prompt_tokens, completion_tokens);
        // Locally or from a pair's prefill node (0 where nothing is cached).
        m.prefix_cache(&self.tenant.id, self.prompt_tokens, self.cached_tokens);
        m.request_duration.observe(self.t0.elapsed());
        tracing::info!(
            request_id = %self.rid,
            tenant = %self.tenant.id,
            endpoint = self.ep.name(),
            status,
            finish_reason = finish,
            prompt_tokens = self.prompt_tokens,
            completion_tokens,
            choices = self.params.n,
            duration_ms = self.t0.elapsed().as_millis() as u64,
            "request done"
        );
    }

    fn decoder(&self) -> Decoder {
        Decoder {
            dec: StreamDecoder::default(),
            stop: StopText::new(self.params.stop.clone()),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            logprobs_sent: 0,
            logprobs_chars: 0,
            last_token_at: None,
        }
    }

    /// Pieces until the end, with the end reason (an end decided together with a last piece
    /// of text is reported on the call after it).
    async fn next_or_end(&mut self, d: &mut Decoder) -> Result<String, End> {
        if let Some(r) = self.pending_end.take() {
            return Err(End::Done(r));
        }
        self.next(d).await
    }

    /// This choice's whole answer: the `choices[i]` object and its token count.
    async fn collect(&mut self) -> Result<ChoiceDone, ApiError> {
        let mut d = self.decoder();
        let mut text = String::new();
        let finish = loop {
            match self.next_or_end(&mut d).await {
                Ok(piece) => text.push_str(&piece),
                Err(End::Done(r)) => break r,
                Err(End::Error(e)) => {
                    // `generate` counts and logs the error answer.
                    let m = &self.st.metrics;
                    m.tokens(&self.tenant.id, self.prompt_tokens, d.tokens.len());
                    return Err(e);
                }
            }
        };
        let (message, finish) = match self.tool_format() {
            Some(format) => {
                let parsed = format.parse(&text, &self.params.tools.tools);
                self.record_tools(format, &parsed.calls).await?;
                let finish = if parsed.calls.is_empty() {
                    finish
                } else {
                    "tool_calls"
                };
                let mut m = json!({"role": "assistant", "content": parsed.content});
                if !parsed.calls.is_empty() {
                    m["tool_calls"] = crate::tools::calls_json(&parsed.calls, &self.rid, false);
                }
                (m, finish)
            }
            None => (json!({"role": "assistant", "content": text}), finish),
        };
        let logprobs = self.logprobs_json(&d.logprobs, 0);
        let mut choice = match self.ep {
            Endpoint::Chat => json!({
                "index": self.choice,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            Endpoint::Completions => json!({
                "index": self.choice,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        if self.params.token_ids {
            choice["token_ids"] = json!(d.tokens);
        }
        Ok(ChoiceDone {
            json: choice,
            status: 200,
            finish,
            completion_tokens: d.tokens.len(),
        })
    }

    /// The call format, when this request offered tools.
    fn tool_format(&self) -> Option<ToolFormat> {
        self.params.tools.choice.as_ref()?;
        self.st.tokenizer.tool_format()
    }

    /// The `request_tools` row: what was offered and what the answer called. Recorded before
    /// the answer is sent, under the log's fail-closed rule (no row, no answer).
    fn answered(&self) -> crate::receipts::AnsweredRequest {
        crate::receipts::AnsweredRequest {
            id: self.id,
            rid: self.rid.clone(),
            promises: self.promises.clone(),
        }
    }

    /// This choice's `custody_receipt` (its request ended, its records all recorded).
    async fn receipt(&mut self) -> Option<Value> {
        self.wait_told().await;
        crate::receipts::custody_receipt(&self.st, &self.tenant.id, &[self.answered()]).await
    }

    /// A pair's request the front ended itself: wait (bounded) until its relay has told the
    /// pair's nodes, so that their logs hold its end before their promises are asked for.
    async fn wait_told(&mut self) {
        if !self.promises.is_empty() {
            return;
        }
        if let Some(told) = self.events.told.take() {
            // A relay that never answers leaves the promises to say why they are missing.
            let _ = tokio::time::timeout(TOLD_WAIT, told).await;
        }
    }

    async fn record_tools(&self, format: ToolFormat, calls: &[ParsedCall]) -> Result<(), ApiError> {
        let t = &self.params.tools;
        let ev = custody_audit::Event::Tools(Box::new(custody_audit::ToolsRecord {
            ts_ns: custody_audit::mono_now_ns(),
            request: self.id,
            tenant: self.tenant.id.to_string().into(),
            format: format.name(),
            tool_choice: t.choice.as_ref().map(|c| c.label()).unwrap_or_default(),
            offered: t.tools.iter().map(|d| d.name.clone()).collect(),
            called: calls.iter().map(|c| c.name.clone()).collect(),
        }));
        self.st.backend.record(ev).await.map_err(|_| {
            ApiError::unavailable(
                "the audit log did not take the request's tool record; the answer is withheld",
                "audit_unavailable",
            )
        })
    }

    /// The `logprobs` object of a choice or chunk over `lps` (`null` when not asked for).
    /// `text_offset` (text completions) counts characters from `offset`.
    fn logprobs_json(&self, lps: &[(u32, Box<TokenLogprobs>)], offset: usize) -> Value {
        if self.params.logprobs.is_none() {
            return Value::Null;
        }
        let tok = &self.st.tokenizer;
        let text = |t: u32| {
            let b = tok.token_bytes(t).map(|b| b.bytes).unwrap_or_default();
            (String::from_utf8_lossy(&b).into_owned(), b)
        };
        match self.ep {
            Endpoint::Chat => {
                let content: Vec<Value> = lps
                    .iter()
                    .map(|(t, lp)| {
                        let (s, b) = text(*t);
                        let top: Vec<Value> = lp
                            .top
                            .iter()
                            .map(|a| {
                                let (s, b) = text(a.token);
                                json!({"token": s, "logprob": a.logprob, "bytes": b})
                            })
                            .collect();
                        json!({"token": s, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Endpoint::Completions => {
                let mut at = offset;
                let (mut tokens, mut lpv, mut tops, mut offsets) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for (t, lp) in lps {
                    let (s, _) = text(*t);
                    // OpenAI's legacy shape: the alternatives and always the sampled token.
                    let mut top = serde_json::Map::new();
                    for a in &lp.top {
                        top.insert(text(a.token).0, json!(a.logprob));
                    }
                    top.entry(s.clone()).or_insert(json!(lp.logprob));
                    offsets.push(at);
                    at += s.chars().count();
                    tokens.push(s);
                    lpv.push(lp.logprob);
                    tops.push(Value::Object(top));
                }
                json!({"tokens": tokens, "token_logprobs": lpv, "top_logprobs": tops, "text_offset": offsets})
            }
        }
    }

    /// Log-probabilities of the tokens received since the last chunk that carried some.
    fn take_chunk_logprobs(&self, d: &mut Decoder) -> Value {
        let from = d.logprobs_sent;
        d.logprobs_sent = d.logprobs.len();
        let v = self.logprobs_json(&d.logprobs[from..], d.logprobs_chars);
        if let Some(Value::Array(tokens)) = v.get("tokens") {
            d.logprobs_chars += tokens
                .iter()
                .filter_map(Value::as_str)
                .map(|s| s.chars().count())
                .sum::<usize>();
        }
        v
    }

    fn chunk(
        &self,
        text: Option<&str>,
        finish: Option<&str>,
        first: bool,
        logprobs: Value,
    ) -> Value {
        let choice = match self.ep {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": self.choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Endpoint::Completions => json!({
                "index": self.choice,
                "text": text.unwrap_or(""),
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id_string(),
            "object": match self.ep { Endpoint::Chat => "chat.completion.chunk", Endpoint::Completions => "text_completion" },
            "created": self.created,
            "model": self.st.model_name,
            "choices": [choice],
        })
    }

    /// The end of a streamed answer with tools: held text sent as content, or held calls parsed
    /// and sent as `delta.tool_calls` (with their `request_tools` row recorded first). Returns
    /// the chunk to send, if any, and whether it carries calls.
    async fn end_held(
        &self,
        format: ToolFormat,
        held: crate::tools::Held,
        first: bool,
    ) -> Result<(Option<Value>, bool), ApiError> {
        let (text, maybe_calls) = match held {
            crate::tools::Held::Undecided(t) => (t, false),
            crate::tools::Held::Text => (String::new(), false),
            crate::tools::Held::Calls(t) => (t, true),
        };
        let parsed = format.parse(&text, &self.params.tools.tools);
        let calls = if maybe_calls {
            parsed.calls
        } else {
            Vec::new()
        };
        self.record_tools(format, &calls).await?;
        if !calls.is_empty() {
            let mut c = self.chunk(None, None, first, Value::Null);
            c["choices"][0]["delta"]["tool_calls"] =
                crate::tools::calls_json(&calls, &self.rid, true);
            if let Some(content) = parsed.content {
                c["choices"][0]["delta"]["content"] = json!(content);
            }
            return Ok((Some(c), true));
        }
        Ok((
            (!text.is_empty()).then(|| self.chunk(Some(&text), None, first, Value::Null)),
            false,
        ))
    }

    /// Stream this choice into `tx` until its final chunk (with `finish_reason`) or its error
    /// event. `None`: the client left (the caller drops the run, which aborts the request).
    async fn stream_choice(&mut self, tx: &mpsc::Sender<SseResult>) -> Option<ChoiceDone> {
        let mut d = self.decoder();
        let mut first = true;
        let format = self.tool_format();
        let mut held = crate::tools::Held::new();
        loop {
            // A client that leaves while its request waits for its first token is noticed
            // here, not only when the next token cannot be sent.
            let next = tokio::select! {
                r = self.next_or_end(&mut d) => r,
                () = tx.closed() => return None,
            };
            match next {
                Ok(piece) => {
                    let piece = match format {
                        Some(f) => held.push(&piece, f.trigger()),
                        None => piece,
                    };
                    if piece.is_empty() {
                        continue;
                    }
                    let lp = self.take_chunk_logprobs(&mut d);
                    let chunk = self.chunk(Some(&piece), None, first, lp);
                    if tx.send(Ok(sse(&chunk))).await.is_err() {
                        return None;
                    }
                    first = false;
                }
                Err(End::Done(mut reason)) => {
                    if let Some(f) = format {
                        match self.end_held(f, std::mem::take(&mut held), first).await {
                            Ok((chunk, calls)) => {
                                if let Some(c) = chunk {
                                    tx.send(Ok(sse(&c))).await.ok()?;
                                    first = false;
                                }
                                if calls && reason == "stop" {
                                    reason = "tool_calls";
                                }
                            }
                            Err(e) => return self.stream_error(tx, e, &d).await,
                        }
                    }
                    let lp = self.take_chunk_logprobs(&mut d);
                    let mut chunk = self.chunk(None, Some(reason), first, lp);
                    if let Some(r) = self.receipt().await {
                        chunk["custody_receipt"] = r;
                    }
                    tx.send(Ok(sse(&chunk))).await.ok()?;
                    return Some(ChoiceDone {
                        json: Value::Null,
                        status: 200,
                        finish: reason,
                        completion_tokens: d.tokens.len(),
                    });
                }
                Err(End::Error(e)) => return self.stream_error(tx, e, &d).await,
            }
        }
    }

    /// A failure after the stream started: an `error` event (what OpenAI's clients raise on).
    async fn stream_error(
        &self,
        tx: &mpsc::Sender<SseResult>,
        e: ApiError,
        d: &Decoder,
    ) -> Option<ChoiceDone> {
        // Not delivered only if the client left: nothing more to tell it.
        let _ = tx.send(Ok(sse(&e.body()))).await;
        Some(ChoiceDone {
            json: Value::Null,
            status: e.status.as_u16(),
            finish: ERROR_FINISH,
            completion_tokens: d.tokens.len(),
        })
    }
}

/// What one choice produced.
struct ChoiceDone {
    /// Its `choices[i]` object (whole answers; `null` when streamed).
    json: Value,
    /// 200, or the status of the error event that ended it.
    status: u16,
    finish: &'static str,
    completion_tokens: usize,
}

/// How long an answer waits for a pair's relay to tell the nodes how its request ended.
const TOLD_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The `finish` of a choice that ended in an error event.
const ERROR_FINISH: &str = "error";

type SseResult = Result<SseEvent, Infallible>;

fn sse(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// The whole answer: every choice collected (the engine computes them together; their events
/// wait in their own channels), then one body. Any choice's error is the answer's.
async fn whole(mut runs: Vec<Run>) -> Result<Response, ApiError> {
    let mut choices = Vec::with_capacity(runs.len());
    for r in &mut runs {
        choices.push(r.collect().await?);
    }
    let total: usize = choices.iter().map(|c| c.completion_tokens).sum();
    for r in &mut runs {
        r.wait_told().await;
    }
    let first = &runs[0];
    let answered: Vec<_> = runs.iter().map(Run::answered).collect();
    let receipt = crate::receipts::custody_receipt(&first.st, &first.tenant.id, &answered).await;
    first.done(200, choices[0].finish, total);
    let mut body = json!({
        "id": first.id_string(),
        "object": match first.ep { Endpoint::Chat => "chat.completion", Endpoint::Completions => "text_completion" },
        "created": first.created,
        "model": first.st.model_name,
        "choices": choices.into_iter().map(|c| c.json).collect::<Vec<_>>(),
        "usage": first.usage(total),
    });
    if let Some(r) = receipt {
        body["custody_receipt"] = r;
    }
    Ok(json_response(StatusCode::OK, &body))
}

/// SSE: each choice's chunks as they come (`index` says whose), each choice's final chunk
/// with its `finish_reason`, optionally a usage chunk, then `[DONE]`. A failure after the
/// stream started is sent as an `error` event and the stream ends without `[DONE]`.
fn stream(runs: Vec<Run>) -> Response {
    // Small and bounded: the writer tasks wait when the client reads slowly (the engine
    // never does: its per-request channel holds the whole output).
    let (tx, rx) = mpsc::channel::<SseResult>(16);
    tokio::spawn(async move {
        let mut runs = runs.into_iter();
        let Some(mut first) = runs.next() else {
            return;
        };
        let siblings: Vec<_> = runs
            .map(|mut r| {
                let tx = tx.clone();
                // Returns the run: dropped here, not before its end is known (a drop before
                // its end aborts it).
                tokio::spawn(async move {
                    let done = r.stream_choice(&tx).await;
                    (r, done)
                })
            })
            .collect();
        let mut ends = vec![first.stream_choice(&tx).await];
        for h in siblings {
            ends.push(h.await.map_or(None, |(_, done)| done));
        }
        // Dropping the runs of a client that left aborts them.
        let Some(ends) = ends.into_iter().collect::<Option<Vec<ChoiceDone>>>() else {
            return;
        };
        let total: usize = ends.iter().map(|e| e.completion_tokens).sum();
        if let Some(e) = ends.iter().find(|e| e.finish == ERROR_FINISH) {
            first.done(e.status, ERROR_FINISH, total);
            return;
        }
        if first.params.include_usage {
            let mut u = first.chunk(None, None, false, Value::Null);
            u["choices"] = json!([]);
            u["usage"] = first.usage(total);
            // Not delivered only if the client left at the very end.
            let _ = tx.send(Ok(sse(&u))).await;
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        first.done(200, ends[0].finish, total);
    });
    let mut r = Sse::new(ReceiverStream::new(rx)).into_response();
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

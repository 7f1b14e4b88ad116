//! Where generations run: the colocated engine thread of this process, or the front door of a
//! disaggregated prefill/decode pair (gRPC `Prefill.Generate`). The HTTP side sees one
//! interface: submit → (request id, a stream of [`Out`]) or an [`ApiError`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use custody_audit as audit;
use custody_runtime::disagg::proto::{self, prefill_client::PrefillClient};
use custody_runtime::engine::{AdmissionError, FinishReason, GenerateRequest};
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::engine_thread::{
    ClientEnd, EndSlot, EngineGauges, EngineGone, EngineHandle, Events, Out, PrefillCheck,
};
use crate::error::ApiError;

/// The serving backend.
#[derive(Clone, Debug)]
pub enum Backend {
    /// This process's engine thread.
    Local(EngineHandle),
    /// A prefill node's front door; `node` is its node id (from its `Info`).
    Prefill {
        client: PrefillClient<Channel>,
        node: u32,
        gauges: Arc<EngineGauges>,
        /// Time to the first event against the prompt's length (see `PrefillCheck`).
        check: PrefillCheck,
        /// This server's own audit log (its node id, `node_events` only: canary results and
        /// prefill anomalies), when it keeps one; the pair's nodes record every page event.
        audit: Option<Arc<dyn audit::AuditSink>>,
    },
    /// The router of a fleet of prefill and decode nodes (`fleet.rs`).
    Fleet(Arc<crate::fleet::Router>),
}

/// An admitted request: its id (`req-<node>-<n>`, `n` the audit `request_id` on `node`) and
/// its events.
pub(crate) type Admitted = (String, u64, Events);

/// A refusal; with the request id when the engine recorded the refusal under one.
pub(crate) type Refused = (Option<String>, ApiError);

impl Backend {
    pub fn gauges(&self) -> &Arc<EngineGauges> {
        match self {
            Backend::Local(h) => &h.gauges,
            Backend::Prefill { gauges, .. } => gauges,
            Backend::Fleet(r) => r.gauges(),
        }
    }

    /// Submit `req`. `cache_salt`: the client's prefix-cache salt, for a pair's prefill node
    /// (which derives the namespace itself); a local engine's request carries its scope already.
    pub(crate) async fn submit(
        &self,
        req: GenerateRequest,
        node: u32,
        cache_salt: Option<&str>,
    ) -> Result<Admitted, Refused> {
        let prompt_tokens = req.prompt.len();
        match self {
            Backend::Local(h) => {
                let (id, admitted) = h.submit(req).await.map_err(|e| (None, gone(&e)))?;
                let rid = format!("req-{node}-{id}");
                match admitted {
                    Ok(events) => Ok((rid, id, events)),
                    Err(e) => Err((Some(rid), admission_error(&e, prompt_tokens))),
                }
            }
            Backend::Prefill {
                client,
                node,
                gauges,
                check,
                audit,
            } => {
                submit_remote(
                    client.clone(),
                    *node,
                    gauges.clone(),
                    *check,
                    audit.clone(),
                    req,
                    cache_salt.unwrap_or_default().to_owned(),
                )
                .await
            }
            Backend::Fleet(r) => r.submit(req, cache_salt.unwrap_or_default()).await,
        }
    }

    /// The server ended a request early (stop sequence, client gone; its [`EndSlot`] says how
    /// the client saw the end). Remote: the relay sees its event channel close and tells the
    /// front door what the slot says (`end_upstream`) before it drops the stream.
    pub(crate) fn end(&self, id: u64) {
        if let Backend::Local(h) = self {
            h.end(id);
        }
    }

    /// Record a server-side audit event: through the engine thread (colocated), or into this
    /// server's own log in front of a pair (none configured: the event is only logged and
    /// counted; the canary's requests are still audited on both nodes, tenant `_canary`).
    pub(crate) async fn record(&self, ev: audit::Event) -> Result<(), EngineGone> {
        match self {
            Backend::Local(h) => h.record(ev).await,
            Backend::Prefill { audit: None, .. } => Ok(()),
            Backend::Fleet(r) => match r.audit() {
                Some(sink) => record_blocking(sink, ev).await,
                None => Ok(()),
            },
            Backend::Prefill {
                audit: Some(sink), ..
            } => record_blocking(sink.clone(), ev).await,
        }
    }
}

/// Record `ev` in a server-side log: the writer's queue is bounded and fail-closed, so this may
/// wait for it — off the async workers.
pub(crate) async fn record_blocking(
    sink: Arc<dyn audit::AuditSink>,
    ev: audit::Event,
) -> Result<(), EngineGone> {
    match tokio::task::spawn_blocking(move || sink.record(ev)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            tracing::error!(error = %e, "recording a server event in the audit log failed");
            Err(EngineGone::Stopped)
        }
        Err(_) => Err(EngineGone::Stopped),
    }
}

fn gone(e: &EngineGone) -> ApiError {
    match e {
        EngineGone::Busy(_) => {
            ApiError::unavailable(format!("server overloaded: {e}"), "engine_queue_full")
        }
        EngineGone::Stopped => ApiError::unavailable(e.to_string(), "engine_stopped"),
    }
}

pub(crate) fn admission_error(e: &AdmissionError, prompt_tokens: usize) -> ApiError {
    match e {
        AdmissionError::ContextExceeded {
            prompt_tokens,
            max_tokens,
            context_length,
        } => ApiError::bad_request(format!(
            "This model's maximum context length is {context_length} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). Please reduce the length of the prompt or max_tokens. Nothing was computed or stored for this request.",
            prompt_tokens + max_tokens
        ))
        .code("context_length_exceeded")
        .param("messages"),
        AdmissionError::ExceedsPool { .. } => ApiError::bad_request(format!(
            "{e} ({prompt_tokens} prompt tokens): this node's KV pool cannot hold the request; reduce the prompt or max_tokens"
        ))
        .code("context_length_exceeded"),
        AdmissionError::EmptyPrompt
        | AdmissionError::ZeroMaxTokens
        | AdmissionError::BadToken { .. }
        | AdmissionError::BadSampling(_) => ApiError::bad_request(e.to_string()),
        AdmissionError::BadDecoding(d) => ApiError::bad_request(e.to_string()).param(d.param()),
        AdmissionError::QueueFull { .. } | AdmissionError::Busy { .. } => {
            ApiError::unavailable(format!("server overloaded: {e}"), "engine_queue_full")
        }
        AdmissionError::AuditUnavailable(_) => {
            ApiError::unavailable(e.to_string(), "audit_unavailable")
        }
    }
}

/// The front door's gRPC status → the HTTP answer (see `disagg::admission_status`).
pub(crate) fn status_error(s: &tonic::Status) -> ApiError {
    use tonic::Code;
    let msg = format!("prefill node: {}", s.message());
    match s.code() {
        Code::InvalidArgument => {
            let e = ApiError::bad_request(format!(
                "{msg}. Nothing was computed or stored for this request."
            ));
            if s.message().contains("exceeds the context length")
                || s.message().contains("KV pages")
            {
                e.code("context_length_exceeded")
            } else {
                e
            }
        }
        Code::ResourceExhausted => ApiError::unavailable(msg, "engine_queue_full"),
        Code::Unavailable => ApiError::unavailable(msg, "backend_unavailable"),
        _ => ApiError::internal(msg, "backend_error"),
    }
}

async fn submit_remote(
    mut client: PrefillClient<Channel>,
    node: u32,
    gauges: Arc<EngineGauges>,
    check: PrefillCheck,
    audit_sink: Option<Arc<dyn audit::AuditSink>>,
    req: GenerateRequest,
    cache_salt: String,
) -> Result<Admitted, Refused> {
    let max_tokens = req.max_tokens;
    let (prompt_tokens, tenant) = (req.prompt.len(), req.tenant.clone());
    let g = generate_request(req, cache_salt, None);
    let opened = open_remote(&mut client, g)
        .await
        .map_err(|s| (None, status_error(&s)))?;
    let id = opened.first.request;
    let anomaly = Anomaly {
        check,
        node,
        tenant: &tenant,
        prompt_tokens,
    };
    anomaly.check(&opened, &gauges, audit_sink.as_ref()).await;
    let events = relay(client, opened, gauges, max_tokens, None);
    Ok((format!("req-{node}-{id}"), id, events))
}

/// The front door's request for `req`.
pub(crate) fn generate_request(
    req: GenerateRequest,
    cache_salt: String,
    route: Option<proto::Route>,
) -> proto::GenerateRequest {
    proto::GenerateRequest {
        tenant: req.tenant,
        prompt: req.prompt,
        max_tokens: u32::try_from(req.max_tokens).unwrap_or(u32::MAX),
        sampling: Some(proto::Sampling {
            temperature: req.sampling.temperature,
            top_k: req.sampling.top_k as u32,
            top_p: req.sampling.top_p,
            seed: req.sampling.seed,
        }),
        stop_ids: req.stop_ids,
        cache_salt,
        route,
        decoding: Some(custody_runtime::disagg::decoding_to_proto(&req.decoding)),
    }
}

/// A front door's stream, past admission: its first event and how long it took.
pub(crate) struct Opened {
    stream: tonic::Streaming<proto::TokenEvent>,
    pub(crate) first: proto::TokenEvent,
    ttft: std::time::Duration,
}

/// Call the front door and wait for its first event (a token, carrying the request id) or an
/// error status, so that refusals are errors here, not broken streams.
pub(crate) async fn open_remote(
    client: &mut PrefillClient<Channel>,
    g: proto::GenerateRequest,
) -> Result<Opened, tonic::Status> {
    let t0 = std::time::Instant::now();
    let mut stream = client.generate(g).await?.into_inner();
    let first = match stream.message().await? {
        Some(ev) => ev,
        None => {
            return Err(tonic::Status::unavailable(
                "the prefill node ended the stream",
            ));
        }
    };
    Ok(Opened {
        stream,
        first,
        ttft: t0.elapsed(),
    })
}

/// The incident's signature, checked on a pair's first event: a long prompt "prefilled" in no
/// time.
pub(crate) struct Anomaly<'a> {
    pub(crate) check: PrefillCheck,
    pub(crate) node: u32,
    pub(crate) tenant: &'a str,
    pub(crate) prompt_tokens: usize,
}

impl Anomaly<'_> {
    pub(crate) async fn check(
        &self,
        o: &Opened,
        gauges: &EngineGauges,
        audit_sink: Option<&Arc<dyn audit::AuditSink>>,
    ) {
        let (check, node, tenant, prompt_tokens) =
            (self.check, self.node, self.tenant, self.prompt_tokens);
        let (id, ttft) = (o.first.request, o.ttft);
        if !o.first.error.is_empty() || !check.is_anomalous(prompt_tokens, ttft) {
            return;
        }
        // The pair's own audit logs hold the pages; this server records the anomaly in its own
        // log when it keeps one, and always as a metric and an ERROR log.
        if let Some(sink) = audit_sink {
            let detail = serde_json::json!({
                "request_id": format!("req-{node}-{id}"),
                "tenant": tenant,
                "prompt_tokens": prompt_tokens,
                "ttft_us": ttft.as_micros() as u64,
                "max_plausible_tok_s": check.max_plausible_tok_s,
            });
            let ev = audit::Event::Node {
                ts_ns: audit::mono_now_ns(),
                kind: "prefill_anomaly".into(),
                detail: detail.to_string(),
            };
            let sink = sink.clone();
            if let Err(e) = tokio::task::spawn_blocking(move || sink.record(ev)).await {
                tracing::error!(error = %e, "recording a prefill anomaly failed");
            }
        }
        gauges
            .prefill_anomalies_total
            .fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            request_id = %format!("req-{node}-{id}"),
            %tenant,
            prompt_tokens,
            ttft_us = ttft.as_micros() as u64,
            max_plausible_tok_s = check.max_plausible_tok_s,
            "PREFILL ANOMALY: the pair's first token came sooner than computing the prompt can take"
        );
    }
}

/// How a relayed request ended, for a router's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RelayEnd {
    Finished {
        reason: String,
        generated: usize,
    },
    Failed(String),
    /// The server or its client ended it (what the front door was told).
    Ended,
}

/// Relay an opened stream's events to the HTTP side. Bounded like the local path: at most
/// `max_tokens` tokens and one terminal event; the relay awaits space, which holds back the
/// gRPC stream (never the engines). `ended` hears how it ended.
pub(crate) fn relay(
    mut client: PrefillClient<Channel>,
    opened: Opened,
    gauges: Arc<EngineGauges>,
    max_tokens: usize,
    ended: Option<tokio::sync::oneshot::Sender<RelayEnd>>,
) -> Events {
    let Opened {
        mut stream, first, ..
    } = opened;
    let (tx, rx) = mpsc::channel(max_tokens.saturating_add(1).min(1 << 16));
    let end = EndSlot::default();
    let said = end.clone();
    let cached_tokens = first.cached_tokens as usize;
    let (told_tx, told) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let how = relay_loop(
            &mut client,
            &mut stream,
            first,
            &tx,
            &gauges,
            cached_tokens,
            &said,
        )
        .await;
        // Not heard only if the request's server side is gone.
        let _ = told_tx.send(());
        if let Some(e) = ended {
            let _ = e.send(how);
        }
    });
    // What the server says in `end` reaches the pair's nodes (`end_upstream`), which record it.
    Events {
        rx,
        end,
        told: Some(told),
    }
}

async fn relay_loop(
    client: &mut PrefillClient<Channel>,
    stream: &mut tonic::Streaming<proto::TokenEvent>,
    first: proto::TokenEvent,
    tx: &mpsc::Sender<Out>,
    gauges: &EngineGauges,
    cached_tokens: usize,
    said: &EndSlot,
) -> RelayEnd {
    let id = first.request;
    let mut generated = 0usize;
    let mut ev = Some(first);
    // Bounded by the stream: it ends after its terminal event.
    loop {
        let e = match ev.take() {
            Some(e) => e,
            None => match tokio::select! {
                m = stream.message() => m,
                () = tx.closed() => {
                    // The server ended the request, or its client went away.
                    end_upstream(client, id, said.get()).await;
                    return RelayEnd::Ended;
                }
            } {
                Ok(Some(e)) => e,
                Ok(None) => {
                    let why = "the prefill node ended the stream early";
                    let _ = tx.send(Out::Aborted(why.into())).await;
                    return RelayEnd::Failed(why.into());
                }
                Err(s) => {
                    let why = format!("prefill node: {}", s.message());
                    let _ = tx.send(Out::Aborted(why.clone())).await;
                    return RelayEnd::Failed(why);
                }
            },
        };
        if !e.error.is_empty() {
            if e.error.contains("integrity") || e.error.contains("tag") {
                gauges
                    .integrity_violations_total
                    .fetch_add(1, Ordering::Relaxed);
            }
            let _ = tx.send(Out::Failed(e.error.clone())).await;
            return RelayEnd::Failed(e.error);
        }
        if e.finish_reason.is_empty() {
            generated += 1;
            if tx
                .send(Out::Token {
                    token: e.token,
                    logprobs: e
                        .logprobs
                        .as_ref()
                        .map(|l| Box::new(custody_runtime::disagg::logprobs_from_proto(l))),
                })
                .await
                .is_err()
            {
                end_upstream(client, id, said.get()).await;
                return RelayEnd::Ended; // dropping the stream aborts what the front door did not end
            }
            continue;
        }
        // A request that ended at its first token carries it in the final event.
        if e.generated_tokens as usize > generated {
            generated += 1;
            if tx
                .send(Out::Token {
                    token: e.token,
                    logprobs: e
                        .logprobs
                        .as_ref()
                        .map(|l| Box::new(custody_runtime::disagg::logprobs_from_proto(l))),
                })
                .await
                .is_err()
            {
                return RelayEnd::Ended;
            }
        }
        let reason = if e.finish_reason == "stop" {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        let _ = tx
            .send(Out::Finished {
                reason,
                prompt_tokens: e.prompt_tokens as usize,
                generated_tokens: generated,
                cached_tokens,
                promises: e
                    .promises
                    .iter()
                    .map(crate::receipts::NodePromise::from_proto)
                    .collect(),
            })
            .await;
        return RelayEnd::Finished {
            reason: e.finish_reason,
            generated,
        };
    }
}

/// How long telling the front door about a request's end may take before the relay gives up
/// (the dropped stream then ends it upstream, recorded `aborted`).
const END_UPSTREAM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Tell the front door how the server ended request `id` (its [`EndSlot`]), so that both nodes
/// record the end as the client saw it: `finished`/`stop` with the tokens in its `usage`, or
/// `aborted` with the reason. Nothing said: the dropped stream is the abort.
async fn end_upstream(client: &mut PrefillClient<Channel>, id: u64, end: Option<&ClientEnd>) {
    let Some(end) = end else { return };
    let (finish_reason, reason) = match &end.kind {
        audit::RequestKind::Finished { reason } => (reason.clone(), String::new()),
        audit::RequestKind::Aborted { reason } => (String::new(), reason.clone()),
        other => (String::new(), other.name().to_owned()),
    };
    let req = proto::EndRequest {
        request: id,
        finish_reason,
        reason,
        delivered_tokens: u32::try_from(end.delivered_tokens).ok(),
    };
    match tokio::time::timeout(END_UPSTREAM_TIMEOUT, client.end(req)).await {
        Ok(Ok(r)) if r.get_ref().existed => {}
        Ok(Ok(_)) => tracing::debug!(request = id, "the pair had already ended the request"),
        Ok(Err(s)) => {
            tracing::warn!(request = id, error = %s.message(), "telling the front door how a request ended failed")
        }
        Err(_) => tracing::warn!(
            request = id,
            "telling the front door how a request ended timed out"
        ),
    }
}

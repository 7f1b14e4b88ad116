//! The engine thread: the one thread that owns the [`Engine`] (and through it the page pool) —
//! the runtime's one engine-thread actor (`custody_runtime::actor`: bounded queue, at most
//! `cmds_per_step` commands between two steps, blocking when idle), as the disaggregated nodes
//! use it.
//!
//! HTTP handlers never touch the engine: they send [`Cmd`]s over a bounded channel and receive
//! each request's tokens over a per-request channel. The per-request channel's capacity is the
//! most events that request can produce (`max_tokens` tokens + one terminal event), so the
//! engine thread's `try_send` never finds it full and never has to wait for a slow client; a
//! closed one (client gone) aborts the request, which releases its pages.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use custody_audit as audit;
use custody_runtime::actor::{self, Actor, ActorLimits, Control, Mailbox, MailboxError, Work};
use custody_runtime::decoding::TokenLogprobs;
use custody_runtime::engine::{
    AdmissionError, Engine, Event, FinishReason, GenerateRequest, RequestId,
};
use tokio::sync::{mpsc, oneshot};

/// What a request's stream carries, in order: tokens, then exactly one terminal event.
#[derive(Clone, Debug, PartialEq)]
pub enum Out {
    Token {
        token: u32,
        /// When the request asked for log-probabilities.
        logprobs: Option<Box<TokenLogprobs>>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        generated_tokens: usize,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: usize,
        /// A pair's or fleet's nodes' signed promises of the request's records (their final
        /// event carries them); empty from this process's own engine.
        promises: Vec<crate::receipts::NodePromise>,
    },
    /// The integrity check refused a read: no further output (the request failed closed).
    Failed(String),
    /// Stopped without output: the audit log is unavailable, or the server is shutting down.
    Aborted(String),
}

impl Out {
    pub fn is_terminal(&self) -> bool {
        !matches!(self, Out::Token { .. })
    }
}

/// The engine's answer to a submission: the id it assigned (also to a rejection, which the
/// audit log records under it) and either the request's events or why it was refused.
pub type SubmitReply = (RequestId, Result<Events, AdmissionError>);

/// An admitted request's side of its route: the engine's events, and the slot where the server
/// says how the request ended for its client when the server, not the engine, ended it.
#[derive(Debug)]
pub struct Events {
    pub rx: mpsc::Receiver<Out>,
    pub end: EndSlot,
    /// A pair's relay: fired once it has told the pair's nodes how the request ended (or the
    /// request ended on its own); `None` for this process's engine.
    pub told: Option<tokio::sync::oneshot::Receiver<()>>,
}

/// How a request ended as its client saw it, when the server ended it before the engine did: a
/// stop sequence matched in the text (`finished`, reason `stop`), the client gone (`aborted`,
/// `client_disconnected`). `delivered_tokens` is what the client received (its `usage`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientEnd {
    pub kind: audit::RequestKind,
    pub delivered_tokens: usize,
}

/// Shared by a request's route (engine thread) and its server side: set once by the server,
/// read by the engine thread when it ends the request — whichever it notices first, the
/// server's end command or the closed event channel, the log records the same end.
#[derive(Clone, Debug, Default)]
pub struct EndSlot(Arc<std::sync::OnceLock<ClientEnd>>);

impl EndSlot {
    /// Say how the request ended for the client (the first statement wins).
    pub fn set(&self, end: ClientEnd) {
        let _ = self.0.set(end);
    }

    pub(crate) fn get(&self) -> Option<&ClientEnd> {
        self.0.get()
    }
}

pub(crate) enum Cmd {
    Submit {
        req: GenerateRequest,
        reply: oneshot::Sender<SubmitReply>,
    },
    /// The server ended the request (stop sequence, client gone): end it as its [`EndSlot`]
    /// says (`aborted`, `client_disconnected` if the slot is empty).
    End(RequestId),
    /// Shutdown's drain timed out: abort everything still running.
    AbortAll(String),
    /// A server-side audit event (canary result, prefill anomaly), recorded through the engine's
    /// sink so that it follows the same fail-closed rule as page events.
    Record(audit::Event),
    /// Finish what is running, then return the engine (even if handles remain).
    Shutdown,
}

/// Engine state for `/metrics` and admission, updated by the engine thread after every step.
#[derive(Debug, Default)]
pub struct EngineGauges {
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    pub pages_total: AtomicU64,
    pub pages_free: AtomicU64,
    /// Pages the prefix cache holds (counted in the used pages; those no request holds are
    /// returned to the pool when it needs them).
    pub prefix_cache_pages: AtomicU64,
    /// Of them, pages no request holds (evictable).
    pub prefix_cache_unheld_pages: AtomicU64,
    pub prefix_cache_evictions_total: AtomicU64,
    /// KV offload (`[kv_offload]`): pages each tier holds (host, disk, object).
    pub offload_pages: [AtomicU64; 3],
    pub offload_offloaded_total: AtomicU64,
    pub offload_restored_total: AtomicU64,
    /// Offloaded pages that failed verification at a restore (each a miss and a violation row).
    pub offload_refused_total: AtomicU64,
    pub offload_evicted_total: AtomicU64,
    pub steps_total: AtomicU64,
    pub integrity_violations_total: AtomicU64,
    pub aborted_total: AtomicU64,
    pub prefill_anomalies_total: AtomicU64,
    /// The engine's audit sink failed: it admits nothing any more (fail-closed).
    pub audit_failed: AtomicBool,
    /// Calibrated prefill throughput at start-up, tokens/s (the anomaly check's yardstick).
    pub calibrated_prefill_tok_s: AtomicU64,
}

/// Why the engine thread could not take a command.
#[derive(Debug, thiserror::Error)]
pub enum EngineGone {
    #[error("the engine's command queue is full ({0} commands); retry later")]
    Busy(usize),
    #[error("the engine thread has stopped")]
    Stopped,
}

/// Flags first tokens that arrive sooner than computing the prompt can take.
#[derive(Clone, Copy, Debug)]
pub struct PrefillCheck {
    /// Fastest plausible prefill, tokens/s (calibrated rate × the configured factor); 0 = off.
    pub max_plausible_tok_s: f64,
    pub min_tokens: usize,
}

impl PrefillCheck {
    /// Whether a first token `ttft` after admission is implausibly early for `prompt_tokens`.
    /// The measured time includes queueing, which only makes it longer, so this never flags a
    /// request that really computed its prompt at up to `max_plausible_tok_s`.
    pub fn is_anomalous(&self, prompt_tokens: usize, ttft: Duration) -> bool {
        if self.max_plausible_tok_s <= 0.0 || prompt_tokens < self.min_tokens {
            return false;
        }
        let floor_s = prompt_tokens as f64 / self.max_plausible_tok_s;
        ttft.as_secs_f64() < floor_s
    }
}

/// Cloneable handle the HTTP side uses.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: Mailbox<Cmd>,
    pub gauges: Arc<EngineGauges>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cmd::Submit { .. } => "Submit",
            Cmd::End(_) => "End",
            Cmd::AbortAll(_) => "AbortAll",
            Cmd::Record(_) => "Record",
            Cmd::Shutdown => "Shutdown",
        })
    }
}

impl EngineHandle {
    /// Submit a request. Never waits for queue space: a full queue is the caller's 503.
    pub async fn submit(&self, req: GenerateRequest) -> Result<SubmitReply, EngineGone> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .try_send(Cmd::Submit { req, reply })
            .map_err(|e| match e {
                MailboxError::Full { capacity, .. } => EngineGone::Busy(capacity),
                MailboxError::Stopped(_) => EngineGone::Stopped,
            })?;
        rx.await.map_err(|_| EngineGone::Stopped)
    }

    /// Queue a control command, waiting for space off the async workers (rare commands only:
    /// shutdown, abort-all, server-side audit records).
    async fn send_waiting(&self, cmd: Cmd) -> Result<(), EngineGone> {
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || tx.send_blocking(cmd).map_err(|_| EngineGone::Stopped))
            .await
            .map_err(|_| EngineGone::Stopped)?
    }

    /// The server ended request `id` (its [`EndSlot`] says how). Best effort: if the queue is
    /// full, the engine still notices the closed event channel at the request's next token and
    /// ends it then, the same way.
    pub fn end(&self, id: RequestId) {
        let _ = self.tx.try_send(Cmd::End(id));
    }

    /// Abort everything in flight (the end of a shutdown drain). Waits for queue space.
    pub async fn abort_all(&self, reason: &str) {
        let _ = self.send_waiting(Cmd::AbortAll(reason.to_owned())).await;
    }

    /// Ask the engine thread to end once its work is done.
    pub async fn shutdown(&self) {
        let _ = self.send_waiting(Cmd::Shutdown).await;
    }

    /// Record a server-side audit event through the engine's sink.
    pub async fn record(&self, ev: audit::Event) -> Result<(), EngineGone> {
        self.send_waiting(Cmd::Record(ev)).await
    }
}

struct Route {
    tx: mpsc::Sender<Out>,
    end: EndSlot,
    admitted: Instant,
    prompt_tokens: usize,
    first_token: bool,
    tenant: Arc<str>,
}

/// Most commands taken between two steps: a flood of submissions cannot starve running
/// requests of steps (the rest wait in the bounded queue).
const CMDS_PER_STEP: usize = 64;

/// The engine thread's state: the engine, the kernels' thread pool, and each request's route.
pub(crate) struct EngineActor {
    pub(crate) engine: Engine,
    pool: custody_runtime::par::ThreadPool,
    routes: HashMap<RequestId, Route>,
    gauges: Arc<EngineGauges>,
    check: PrefillCheck,
}

impl Actor for EngineActor {
    type Cmd = Cmd;
    /// Shutdown finishes what is running, then returns the engine.
    const FINISH_WORK_ON_CLOSE: bool = true;

    fn handle(&mut self, cmd: Cmd) -> Control {
        if matches!(cmd, Cmd::Shutdown) {
            return Control::Close;
        }
        handle(&mut self.engine, &mut self.routes, cmd, &self.gauges);
        Control::Continue
    }

    fn work(&mut self) -> Work {
        if !self.engine.has_work() {
            update_gauges(&self.engine, &self.gauges);
            return Work::Idle;
        }
        let events = self.pool.install(|| self.engine.step());
        self.gauges.steps_total.fetch_add(1, Ordering::Relaxed);
        for ev in events {
            route(
                &mut self.engine,
                &mut self.routes,
                ev,
                &self.gauges,
                &self.check,
            );
        }
        update_gauges(&self.engine, &self.gauges);
        Work::Busy
    }
}

/// Spawn the engine thread. `engine` may already have run start-up work (calibration, the
/// canary reference). Returns the handle and the thread, which returns the engine's actor (its
/// `engine`) when every handle is dropped or shutdown was asked, and no work is left.
pub(crate) fn spawn(
    engine: Engine,
    pool: custody_runtime::par::ThreadPool,
    capacity: usize,
    check: PrefillCheck,
    gauges: Arc<EngineGauges>,
) -> std::io::Result<(EngineHandle, std::thread::JoinHandle<EngineActor>)> {
    update_gauges(&engine, &gauges);
    let actor = EngineActor {
        engine,
        pool,
        routes: HashMap::new(),
        gauges: gauges.clone(),
        check,
    };
    let limits = ActorLimits {
        queue_capacity_cmds: capacity,
        cmds_per_step: CMDS_PER_STEP,
    };
    let (tx, join) = actor::spawn("engine", actor, limits)?;
    Ok((EngineHandle { tx, gauges }, join))
}

fn update_gauges(engine: &Engine, g: &EngineGauges) {
    g.waiting
        .store(engine.n_waiting() as u64, Ordering::Relaxed);
    g.running
        .store(engine.n_running() as u64, Ordering::Relaxed);
    g.pages_total
        .store(engine.pool().n_pages() as u64, Ordering::Relaxed);
    g.pages_free
        .store(engine.pool().n_free() as u64, Ordering::Relaxed);
    if let Some(c) = engine.prefix_cache_stats() {
        g.prefix_cache_pages
            .store(c.entries as u64, Ordering::Relaxed);
        g.prefix_cache_unheld_pages
            .store((c.entries - c.held) as u64, Ordering::Relaxed);
        g.prefix_cache_evictions_total
            .store(c.evictions, Ordering::Relaxed);
    }
    if let Some(s) = engine.offload_stats() {
        for (tier, pages) in engine.offload_pages() {
            let i = match tier {
                custody_runtime::offload::store::Tier::Host => 0,
                custody_runtime::offload::store::Tier::Disk => 1,
                custody_runtime::offload::store::Tier::Object => 2,
            };
            g.offload_pages[i].store(pages as u64, Ordering::Relaxed);
        }
        g.offload_offloaded_total
            .store(s.offloaded, Ordering::Relaxed);
        g.offload_restored_total
            .store(s.restored, Ordering::Relaxed);
        g.offload_refused_total.store(s.refused, Ordering::Relaxed);
        g.offload_evicted_total.store(s.evicted, Ordering::Relaxed);
    }
    g.audit_failed
        .store(engine.audit_error().is_some(), Ordering::Relaxed);
}

fn handle(
    engine: &mut Engine,
    routes: &mut HashMap<RequestId, Route>,
    cmd: Cmd,
    gauges: &EngineGauges,
) {
    match cmd {
        Cmd::Submit { req, reply } => {
            let id = engine.next_request_id();
            let prompt_tokens = req.prompt.len();
            let tenant: Arc<str> = req.tenant.as_str().into();
            // Bounded by what the request can produce: see the module doc.
            let (tx, rx) = mpsc::channel(req.max_tokens.saturating_add(1));
            let end = EndSlot::default();
            let result = engine.submit(req).map(|got| {
                debug_assert_eq!(got, id);
                routes.insert(
                    id,
                    Route {
                        tx,
                        end: end.clone(),
                        admitted: Instant::now(),
                        prompt_tokens,
                        first_token: false,
                        tenant,
                    },
                );
                Events {
                    rx,
                    end,
                    told: None,
                }
            });
            if let Err((_, Ok(_))) = reply.send((id, result)) {
                // The caller went away between submitting and hearing back.
                engine.abort(id, CLIENT_DISCONNECTED);
                routes.remove(&id);
            }
        }
        Cmd::End(id) => {
            if let Some(r) = routes.remove(&id) {
                end_as_the_client_saw(engine, id, &r, gauges);
            }
        }
        Cmd::AbortAll(reason) => {
            for (id, r) in routes.drain() {
                engine.abort(id, &reason);
                gauges.aborted_total.fetch_add(1, Ordering::Relaxed);
                let _ = r.tx.try_send(Out::Aborted(reason.clone()));
            }
        }
        Cmd::Record(ev) => engine.record(ev),
        Cmd::Shutdown => {}
    }
}

fn route(
    engine: &mut Engine,
    routes: &mut HashMap<RequestId, Route>,
    ev: Event,
    gauges: &EngineGauges,
    check: &PrefillCheck,
) {
    let (id, out) = match ev {
        Event::Token {
            id,
            token,
            logprobs,
        } => (id, Out::Token { token, logprobs }),
        Event::Finished {
            id,
            reason,
            prompt_tokens,
            generated_tokens,
            cached_tokens,
        } => (
            id,
            Out::Finished {
                reason,
                prompt_tokens,
                generated_tokens,
                cached_tokens,
                promises: Vec::new(),
            },
        ),
        Event::Failed { id, error } => {
            gauges
                .integrity_violations_total
                .fetch_add(1, Ordering::Relaxed);
            (id, Out::Failed(error.to_string()))
        }
        Event::Aborted { id, reason } => {
            gauges.aborted_total.fetch_add(1, Ordering::Relaxed);
            (id, Out::Aborted(reason))
        }
        // Prefill-only requests are never submitted here.
        Event::Prefilled { .. } => return,
    };
    let Some(r) = routes.get_mut(&id) else {
        return;
    };
    if !r.first_token && matches!(out, Out::Token { .. } | Out::Finished { .. }) {
        r.first_token = true;
        let ttft = r.admitted.elapsed();
        if check.is_anomalous(r.prompt_tokens, ttft) {
            gauges
                .prefill_anomalies_total
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                request = id,
                tenant = %r.tenant,
                prompt_tokens = r.prompt_tokens,
                ttft_us = ttft.as_micros() as u64,
                max_plausible_tok_s = check.max_plausible_tok_s,
                "PREFILL ANOMALY: first token sooner than computing the prompt can take"
            );
            let detail = serde_json::json!({
                "request": id,
                "tenant": &*r.tenant,
                "prompt_tokens": r.prompt_tokens,
                "ttft_ns": ttft.as_nanos() as u64,
                "max_plausible_tok_s": check.max_plausible_tok_s,
            });
            engine.record(audit::Event::Node {
                ts_ns: audit::mono_now_ns(),
                kind: "prefill_anomaly".into(),
                detail: detail.to_string(),
            });
        }
    }
    let terminal = out.is_terminal();
    let gone = r.tx.try_send(out).is_err();
    if terminal {
        routes.remove(&id);
    } else if gone {
        // The client went away (or, impossibly, overran its bound): stop computing for it.
        if let Some(r) = routes.remove(&id) {
            end_as_the_client_saw(engine, id, &r, gauges);
        }
    }
}

/// The `aborted` reason of a request whose client went away.
const CLIENT_DISCONNECTED: &str = "client_disconnected";

/// End a request the server ended, recorded as its [`EndSlot`] says (the client's view);
/// without a statement, the client went away: `aborted`, every produced token counted.
fn end_as_the_client_saw(engine: &mut Engine, id: RequestId, r: &Route, gauges: &EngineGauges) {
    let ended = match r.end.get() {
        Some(end) => engine.end_early(id, end.kind.clone(), Some(end.delivered_tokens)),
        None => engine.abort(id, CLIENT_DISCONNECTED),
    };
    let finished = matches!(r.end.get(), Some(e) if e.kind.name() == "finished");
    if ended && !finished {
        gauges.aborted_total.fetch_add(1, Ordering::Relaxed);
    }
}

/// Why a request run alone did not finish.
#[derive(Debug, thiserror::Error)]
pub enum RunAloneError {
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error("integrity check failed: {0}")]
    Integrity(custody_runtime::engine::IntegrityError),
    #[error("aborted: {0}")]
    Aborted(String),
    #[error("the request did not finish within {steps} steps")]
    DidNotFinish { steps: usize },
}

/// Most engine steps a request run alone may take (each advances the prompt or emits a token).
const RUN_ALONE_MAX_STEPS: usize = 100_000;

/// Run one request alone to its end on an engine nobody else is using (start-up work):
/// its tokens and time to first token, or why it did not finish.
pub fn run_alone(
    engine: &mut Engine,
    pool: &custody_runtime::par::ThreadPool,
    req: GenerateRequest,
) -> Result<(Vec<u32>, Duration), RunAloneError> {
    let id = engine.submit(req)?;
    let t0 = Instant::now();
    let mut ttft = None;
    let mut tokens = Vec::new();
    // Bounded: every step either advances the prompt or emits a token, and max_tokens bounds
    // the tokens; a request that somehow does not end within this many steps is an error.
    for _ in 0..RUN_ALONE_MAX_STEPS {
        if !engine.has_work() {
            break;
        }
        for ev in pool.install(|| engine.step()) {
            match ev {
                Event::Token { id: r, token, .. } if r == id => {
                    ttft.get_or_insert_with(|| t0.elapsed());
                    tokens.push(token);
                }
                Event::Finished { id: r, .. } if r == id => {
                    return Ok((tokens, ttft.unwrap_or_else(|| t0.elapsed())));
                }
                Event::Failed { id: r, error } if r == id => {
                    return Err(RunAloneError::Integrity(error));
                }
                Event::Aborted { id: r, reason } if r == id => {
                    return Err(RunAloneError::Aborted(reason));
                }
                _ => {}
            }
        }
    }
    Err(RunAloneError::DidNotFinish {
        steps: RUN_ALONE_MAX_STEPS,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_check_flags_only_implausibly_early_first_tokens() {
        let c = PrefillCheck {
            max_plausible_tok_s: 10_000.0,
            min_tokens: 64,
        };
        // 1000 tokens cannot be computed in under 100 ms at 10k tok/s.
        assert!(c.is_anomalous(1000, Duration::from_millis(5)));
        assert!(!c.is_anomalous(1000, Duration::from_millis(150)));
        // Short prompts are not judged.
        assert!(!c.is_anomalous(10, Duration::from_nanos(1)));
        let off = PrefillCheck {
            max_plausible_tok_s: 0.0,
            min_tokens: 0,
        };
        assert!(!off.is_anomalous(1000, Duration::ZERO));
    }
}

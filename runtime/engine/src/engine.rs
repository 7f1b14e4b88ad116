//! The engine: admission, continuous batching, and the request state machine.
//!
//! # Request lifecycle (typed)
//! `submit` either rejects (an [`AdmissionError`], before any page is allocated — safety property
//! 3, "no silent truncation": a prompt is served whole or refused) or queues the request. A queued
//! request is scheduled when its *whole* page reservation (`prompt + max_tokens` slots) fits in
//! the pool; then it is `Prefill` until every prompt token's KV is written, then `Decode`. It ends
//! `Finished` (stop token or length) or `Failed` (an integrity error: no further token is emitted
//! for it), and its pages are released. Other requests in the same batch are unaffected.
//!
//! # Scheduling (continuous batching)
//! Each [`Engine::step`] runs one forward pass over a batch of at most `max_batch_tokens` tokens:
//! one token for every decoding request, then prefill chunks of waiting prompts (FIFO) in the
//! remaining budget. Decode never waits for a long prefill to finish.

use std::collections::VecDeque;
use std::sync::Arc;

use custody_audit::{self as audit, AuditSink, PageKind, RequestKind};

use custody_kernels::attention::{KvType, PageRef, Reader, ReduceOrder, TagCheck};

use crate::config::{EngineConfig, UnsafeReproduction};
use crate::cuda_forward::{CudaForward, CudaForwardError};
use crate::decoding::{DecodeState, Decoding, TokenLogprobs};
use crate::grammar::GrammarError;
use crate::kv::{PagePool, PoolError, PoolView};
use crate::model::{Logits, Model, Rows, Scratch, Segment};
use crate::prefix_cache::{BlockKey, CacheScope, CachedPage, PrefixCache, ScopeKind};
use crate::sampling::{Sampler, SamplingParams};
use custody_cuda::{Device, DeviceError};

mod decode;
mod prefill;
mod tiers;

pub use decode::{DecodeEngine, ImportError, ReleaseRefused};
pub use prefill::PrefillEngine;

/// The integrity error a failed request carries ([`Event::Failed`]).
pub use custody_kernels::attention::IntegrityError;

pub type RequestId = u64;

/// Why a request was refused at admission. Nothing was allocated for it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error(
        "prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the context length of {context_length} tokens"
    )]
    ContextExceeded {
        prompt_tokens: usize,
        max_tokens: usize,
        context_length: usize,
    },
    #[error("request needs {needed_pages} KV pages but the pool has {pool_pages}")]
    ExceedsPool {
        needed_pages: usize,
        pool_pages: usize,
    },
    #[error("the wait queue is full ({max_waiting} requests)")]
    QueueFull { max_waiting: usize },
    #[error("invalid sampling parameters: {0}")]
    BadSampling(crate::sampling::SamplingError),
    #[error("{0}")]
    BadDecoding(crate::decoding::DecodingError),
    #[error("the audit log is unavailable, so no work is admitted: {0}")]
    AuditUnavailable(String),
    #[error("the KV pool is busy: {needed_pages} pages needed, {free_pages} free; retry later")]
    Busy {
        needed_pages: usize,
        free_pages: usize,
    },
}

impl AdmissionError {
    /// Whether this rejection is about the request's length (context or pool capacity): the
    /// errors the incident's legacy path "handled" by truncating the prompt.
    pub fn is_over_length(&self) -> bool {
        matches!(
            self,
            AdmissionError::ContextExceeded { .. } | AdmissionError::ExceedsPool { .. }
        )
    }
}

/// Why the engine refused to start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(
        "KV pool of {pool_tokens} tokens ({kv_budget_mib} MiB at {bytes_per_token} B/token) cannot hold one full context of {context_length} tokens; raise engine.kv_budget_mib or set engine.allow_context_reduction = true"
    )]
    PoolTooSmall {
        pool_tokens: usize,
        context_length: usize,
        kv_budget_mib: usize,
        bytes_per_token: usize,
    },
    #[error("configured context length {configured} exceeds the model's trained context {model}")]
    ContextBeyondModel { configured: usize, model: usize },
    #[error("invalid engine config: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("engine.backend = \"cuda\" cannot start: {0}")]
    Backend(String),
}

/// A generation request over token ids.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Logit biases, penalties, an output constraint, log-probabilities (`decoding.rs`).
    pub decoding: Decoding,
    /// Tokens that end generation (not emitted).
    pub stop_ids: Vec<u32>,
    /// Whose data the prompt is (recorded with every page event).
    pub tenant: String,
    /// Where its full pages may be cached and looked up (`None`: never), set by whoever
    /// authenticated the tenant — the engine derives no namespace itself. Ignored when
    /// `engine.prefix_cache` is off.
    pub cache: Option<CacheScope>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` were produced.
    Length,
}

/// What a step produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token {
        id: RequestId,
        token: u32,
        /// Its log-probability and alternatives, when the request asked for them.
        logprobs: Option<Box<TokenLogprobs>>,
    },
    Finished {
        id: RequestId,
        reason: FinishReason,
        prompt_tokens: usize,
        generated_tokens: usize,
        /// Prompt tokens whose KV came from the prefix cache (not computed for this request).
        cached_tokens: usize,
    },
    Failed {
        id: RequestId,
        error: IntegrityError,
    },
    /// Stopped without output because the engine cannot record what it does (audit failure).
    Aborted { id: RequestId, reason: String },
    /// A prefill-only request's prompt KV is complete (pages held for the transfer) and its
    /// first token sampled.
    Prefilled {
        id: RequestId,
        first_token: u32,
        /// The first token's log-probabilities, when the request asked for them.
        first_logprobs: Option<Box<TokenLogprobs>>,
        /// Prompt tokens whose KV came from the prefix cache.
        cached_tokens: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// KV written for `Seq::n_cached` of the prompt tokens so far.
    Prefill,
    /// Prompt complete; `next_input` is the last sampled token, not yet in the KV cache.
    Decode { next_input: u32 },
}

#[derive(Debug)]
struct Seq {
    id: RequestId,
    prompt: Vec<u32>,
    max_tokens: usize,
    stop_ids: Vec<u32>,
    sampler: Sampler,
    /// Biases, penalties, the constraint, log-probabilities.
    decode: DecodeState,
    pages: Vec<PageRef>,
    /// Slots whose KV this sequence has written (its next position).
    n_cached: usize,
    generated: usize,
    phase: Phase,
    tenant: Arc<str>,
    /// Run-length read record per logical page: (slot_end, first_step, last_step).
    reads: Vec<Option<(u32, u32, u32)>>,
    /// What the request asks of this engine.
    goal: Goal,
    /// Its cache namespaces (`None`: it neither reads nor publishes cached pages).
    cache: Option<CacheScope>,
    /// Chain keys of its leading pages that are cached (shared) pages — hits, then the pages
    /// it published itself; `pages[keys.len()..]` are its own.
    keys: Vec<BlockKey>,
    /// Whether its next full page may still be published (false once a key was already cached
    /// by another writer, or a share was refused).
    publishing: bool,
    /// Prompt tokens taken from the cache at admission.
    cached_tokens: usize,
    /// Its output tokens so far (the KV of all but the last is written).
    output: Vec<u32>,
    /// The offload keys its submission started prefetching, and how long its admission waits
    /// for them.
    prefetch: Option<(Vec<BlockKey>, std::time::Instant)>,
}

/// What a request asks of the engine that runs it. Only [`PrefillEngine`] admits
/// [`Goal::PrefillOnly`]: a single-node or decode engine never holds a prefilled sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Goal {
    /// Prompt, then tokens until a stop token or `max_tokens`.
    Generate,
    /// Prefill node: the prompt's KV and the first sampled token; the pages are then handed to
    /// the caller (held for the transfer).
    PrefillOnly,
}

/// Applies every sampling sequence's decoding options to its logits (`wants`: per planned
/// row, its index in `running` and whether it samples this step), returning each row's error.
/// The constraints' masks are the costly part (~0.2 ms each for a JSON schema over a 49k
/// vocabulary): with two or more, they are computed on the compute pool's threads, one
/// sequence per thread at a time, instead of one after another on the engine thread.
fn shape_logits(
    running: &mut [Seq],
    wants: &[(usize, bool)],
    results: &mut [Result<Vec<f32>, IntegrityError>],
) -> Vec<Option<GrammarError>> {
    let mut errors: Vec<Option<GrammarError>> = wants.iter().map(|_| None).collect();
    let mut states: Vec<Option<&mut DecodeState>> =
        running.iter_mut().map(|s| Some(&mut s.decode)).collect();
    let jobs: Vec<std::sync::Mutex<ShapeJob<'_>>> = wants
        .iter()
        .zip(results.iter_mut())
        .zip(errors.iter_mut())
        .filter_map(|((&(i, want), res), error)| {
            let logits = res.as_mut().ok().filter(|_| want)?;
            let state = states.get_mut(i)?.take()?;
            Some(std::sync::Mutex::new(ShapeJob {
                state,
                logits,
                error,
            }))
        })
        .collect();
    let masks = jobs
        .iter()
        .filter(|j| j.lock().is_ok_and(|j| j.state.constrained()))
        .count();
    let work = |part: usize, n_parts: usize| {
        for j in jobs.iter().skip(part).step_by(n_parts) {
            // Each job is locked by exactly one part: never contended, never poisoned but by a
            // panic that `par::run` re-raises.
            let mut g = j.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let ShapeJob {
                state,
                logits,
                error,
            } = &mut *g;
            if let Err(e) = state.shape(logits) {
                **error = Some(e);
            }
        }
    };
    if masks >= 2 {
        custody_kernels::par::run(&work);
    } else {
        work(0, 1);
    }
    drop(jobs);
    errors
}

/// One sequence's logits to shape (`shape_logits`).
struct ShapeJob<'a> {
    state: &'a mut DecodeState,
    logits: &'a mut Vec<f32>,
    error: &'a mut Option<GrammarError>,
}

/// A sampled token.
struct Picked {
    token: u32,
    logprobs: Option<Box<TokenLogprobs>>,
    /// It is one of the request's stop tokens (not emitted).
    stop: bool,
}

/// What one step produced: events, and (prefill role only) the sequences whose prompt KV is now
/// complete, handed to the [`PrefillEngine`] that holds them for their transfer.
struct StepOutput {
    events: Vec<Event>,
    prefilled: Vec<Seq>,
}

impl Seq {
    /// Token slots this sequence reserves: its prompt, plus its output unless it only prefills.
    fn reserve_tokens(&self) -> usize {
        if self.goal == Goal::PrefillOnly {
            self.prompt.len()
        } else {
            self.prompt.len() + self.max_tokens
        }
    }

    fn new(id: RequestId, req: GenerateRequest, goal: Goal) -> Self {
        Seq {
            id,
            prompt: req.prompt,
            max_tokens: req.max_tokens,
            stop_ids: req.stop_ids,
            sampler: Sampler::new(req.sampling),
            decode: DecodeState::new(req.decoding),
            pages: Vec::new(),
            n_cached: 0,
            generated: 0,
            phase: Phase::Prefill,
            tenant: req.tenant.into(),
            reads: Vec::new(),
            goal,
            publishing: req.cache.is_some(),
            cache: req.cache,
            keys: Vec::new(),
            cached_tokens: 0,
            output: Vec::new(),
            prefetch: None,
        }
    }

    /// The next token from this step's logits, already shaped by the request's decoding options
    /// ([`shape_logits`]): sampled, and recorded (penalty counts, the constraint advanced).
    fn choose(&mut self, logits: Vec<f32>) -> Result<Picked, GrammarError> {
        let token = self.sampler.sample(&logits);
        let logprobs = self.decode.logprobs(&logits, token).map(Box::new);
        let stop = self.stop_ids.contains(&token);
        self.decode.accept(token, stop)?;
        Ok(Picked {
            token,
            logprobs,
            stop,
        })
    }

    /// Who this sequence reads as: its own pages, and the shared pages of its namespaces.
    fn reader(&self) -> Reader {
        match &self.cache {
            Some(c) => Reader::with_shared(self.id, &c.tags()),
            None => Reader::private(self.id),
        }
    }
}

/// The engine core: admission, continuous batching over `waiting` and `running`, the page pool
/// and the audit sink. Used as is by a single node; the disaggregated roles wrap it
/// ([`PrefillEngine`] owns the held set, [`DecodeEngine`] the importing and quarantined sets), so
/// a sequence in the core never carries a live transfer key. Not `Sync`: one scheduler thread
/// drives it; kernels parallelise inside.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    pool: PagePool,
    cfg: EngineConfig,
    context_length: usize,
    next_id: RequestId,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    compute: Compute,
    sink: Option<Arc<dyn AuditSink>>,
    /// Set when the sink refused an event: the engine then admits and runs nothing (fail-closed).
    audit_error: Option<String>,
    step_no: u32,
    tag_check: TagCheck,
    /// The prefix cache (`engine.prefix_cache`; CPU backend).
    cache: Option<PrefixCache>,
    /// KV offload of the prefix cache's evicted pages (`[kv_offload]`; needs the cache).
    offload: Option<crate::offload::Offload>,
    /// Fault injection only: every lookup uses this scope instead of the request's (a buggy
    /// index that hands out another namespace's pages).
    #[cfg(feature = "fault-injection")]
    fault_lookup_scope: Option<CacheScope>,
}

/// What the forward pass runs on: the backend boundary, chosen once at startup
/// (`engine.backend`). Everything else — admission, scheduling, the pool's tags, audit events —
/// is the same code for both.
enum Compute {
    /// [`Model::forward`] on this machine's cores, K/V in the pool's host memory.
    Cpu(Box<Scratch>),
    /// [`CudaForward`] on a device: K/V in one device allocation, the pool keeps the tags (its
    /// host K/V bytes are never touched: zero pages the OS never backs).
    Device(Box<CudaForward<Box<dyn Device>>>),
}

impl std::fmt::Debug for Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compute::Cpu(_) => f.write_str("Cpu"),
            Compute::Device(d) => write!(f, "Device({})", d.describe()),
        }
    }
}

/// The batch's results per segment, or — a device failure, which is not one segment's — why
/// the whole batch did not run.
fn run_forward(
    compute: &mut Compute,
    model: &Model,
    pool: &mut PagePool,
    segments: &[Segment<'_>],
) -> Result<Vec<Result<Vec<f32>, IntegrityError>>, CudaForwardError> {
    match compute {
        Compute::Cpu(scratch) => Ok(model.forward(pool, segments, scratch)),
        Compute::Device(d) => d.forward(pool, segments),
    }
}

/// `backend = "cuda"`: device 0, or why it cannot be used (what is missing on this machine or
/// in this build).
fn open_cuda() -> Result<Box<dyn Device>, StartupError> {
    #[cfg(feature = "cuda")]
    {
        custody_cuda::CudaDevice::open(0)
            .map(|d| Box::new(d) as Box<dyn Device>)
            .map_err(|e| StartupError::Backend(e.to_string()))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(StartupError::Backend(
            custody_cuda::open(0).err().map_or_else(
                || "this build has no CUDA support".to_owned(),
                |e| e.to_string(),
            ),
        ))
    }
}

impl Engine {
    /// Size the pool from the memory budget and check it against the context length.
    pub fn new(model: Model, cfg: EngineConfig) -> Result<Self, StartupError> {
        Self::new_with_unsafe(model, cfg, &UnsafeReproduction::default())
    }

    /// [`Engine::new`] on `device` (whatever `cfg.backend` says): the CUDA backend on a device
    /// the caller opened — a GPU ([`custody_cuda::CudaDevice`]) or the test crate's
    /// CUDA-on-CPU shim. The pool is sized and checked exactly as on the CPU.
    pub fn new_on_device(
        model: Model,
        cfg: EngineConfig,
        device: Box<dyn Device>,
    ) -> Result<Self, StartupError> {
        let cfg = EngineConfig {
            backend: crate::config::Backend::Cuda,
            ..cfg
        };
        Self::build(model, cfg, &UnsafeReproduction::default(), Some(device))
    }

    /// [`Engine::new`] with the incident reproduction's switches (already armed by the caller's
    /// `--unsafe-reproduction`; see [`UnsafeReproduction`]).
    pub fn new_with_unsafe(
        model: Model,
        cfg: EngineConfig,
        unsafe_: &UnsafeReproduction,
    ) -> Result<Self, StartupError> {
        Self::build(model, cfg, unsafe_, None)
    }

    fn build(
        model: Model,
        cfg: EngineConfig,
        unsafe_: &UnsafeReproduction,
        device: Option<Box<dyn Device>>,
    ) -> Result<Self, StartupError> {
        cfg.validate()?;
        let cuda = cfg.backend == crate::config::Backend::Cuda;
        if cuda && (unsafe_.disable_tag_check || unsafe_.skip_pool_check) {
            return Err(StartupError::Backend(
                "the incident reproduction runs on the CPU backend only".into(),
            ));
        }
        if cuda && cfg.kv_cache_type != KvType::F16 {
            return Err(StartupError::Backend(format!(
                "engine.kv_cache_type = {:?} runs on the CPU backend only (the CUDA kernels \
                 read f16 pages)",
                cfg.kv_cache_type.name()
            )));
        }
        if !cfg.kv_cache_type.supports(model.config.head_dim) {
            return Err(StartupError::Config(crate::config::ConfigError::Invalid(
                format!(
                    "engine.kv_cache_type = {:?} stores whole blocks of 32 values; this \
                     model's head_dim is {}",
                    cfg.kv_cache_type.name(),
                    model.config.head_dim
                ),
            )));
        }
        // The device is opened before anything is sized: a missing one is the first error.
        let device = match (cuda, device) {
            (true, Some(d)) => Some(d),
            (true, None) => Some(open_cuda()?),
            (false, _) => None,
        };
        let model_ctx = model.config.context_length;
        let mut context_length = cfg.context_length.unwrap_or(model_ctx);
        if context_length > model_ctx {
            return Err(StartupError::ContextBeyondModel {
                configured: context_length,
                model: model_ctx,
            });
        }
        let geom = model.page_geometry(cfg.page_size, cfg.kv_cache_type);
        let bytes_per_token = PagePool::bytes_per_token(geom, model.config.n_layers);
        let n_pages = cfg.kv_budget_mib * (1 << 20) / (bytes_per_token * cfg.page_size);
        let pool_tokens = n_pages * cfg.page_size;
        tracing::info!(
            pool_tokens,
            pool_pages = n_pages,
            page_size = cfg.page_size,
            bytes_per_token,
            context_length,
            "KV pool sized"
        );
        if pool_tokens < context_length && unsafe_.skip_pool_check && pool_tokens > 0 {
            tracing::error!(
                pool_tokens,
                context_length,
                "UNSAFE REPRODUCTION: KV pool smaller than the advertised context and the startup check is SKIPPED"
            );
        } else if pool_tokens < context_length {
            if !cfg.allow_context_reduction || pool_tokens == 0 {
                return Err(StartupError::PoolTooSmall {
                    pool_tokens,
                    context_length,
                    kv_budget_mib: cfg.kv_budget_mib,
                    bytes_per_token,
                });
            }
            tracing::warn!(
                configured = context_length,
                lowered_to = pool_tokens,
                "KV POOL SMALLER THAN CONTEXT: context length LOWERED to what the pool holds (engine.allow_context_reduction = true)"
            );
            context_length = pool_tokens;
        }
        let prefix_cache = cfg.prefix_cache.unwrap_or(true);
        let pool = PagePool::new(geom, model.config.n_layers, n_pages);
        let compute = match device {
            None => Compute::Cpu(Box::default()),
            Some(d) => {
                let f = CudaForward::new(d, &model, &pool, cfg.max_batch_tokens)
                    .map_err(|e| StartupError::Backend(e.to_string()))?;
                tracing::info!(device = %f.describe(), pool_pages = n_pages, "CUDA backend ready");
                Compute::Device(Box::new(f))
            }
        };
        let cache = prefix_cache.then(PrefixCache::new);
        if cache.is_some() {
            tracing::info!("prefix cache on");
        }
        Ok(Self {
            model,
            pool,
            cfg,
            context_length,
            next_id: 1,
            waiting: VecDeque::new(),
            running: Vec::new(),
            compute,
            sink: None,
            audit_error: None,
            step_no: 0,
            cache,
            offload: None,
            #[cfg(feature = "fault-injection")]
            fault_lookup_scope: None,
            tag_check: if unsafe_.disable_tag_check {
                tracing::error!("UNSAFE REPRODUCTION: the KV page tag check is DISABLED");
                TagCheck::DisabledForIncidentReproduction
            } else {
                TagCheck::Enforced
            },
        })
    }

    /// Whether the K/V bytes live on a device (the CUDA backend) rather than in the pool's host
    /// memory. The disaggregated transfer path reads and lands host memory, so on a device the
    /// roles stage pages through it ([`Engine::stage_to_host`], [`Engine::stage_to_device`]).
    pub fn kv_on_device(&self) -> bool {
        matches!(self.compute, Compute::Device(_))
    }

    /// The CUDA backend: `pages`' device K/V into the pool's host memory (a prefilled
    /// sequence's, before its transfer reads them). Nothing to do on the CPU.
    pub(crate) fn stage_to_host(&mut self, pages: &[PageRef]) -> Result<(), DeviceError> {
        match &mut self.compute {
            Compute::Cpu(_) => Ok(()),
            Compute::Device(d) => d.stage_to_host(&mut self.pool, pages),
        }
    }

    /// The CUDA backend: `pages`' landed, verified K/V from the pool's host memory to the
    /// device (before decode reads them). Nothing to do on the CPU.
    pub(crate) fn stage_to_device(&mut self, pages: &[PageRef]) -> Result<(), DeviceError> {
        match &mut self.compute {
            Compute::Cpu(_) => Ok(()),
            Compute::Device(d) => d.stage_to_device(&mut self.pool, pages),
        }
    }

    /// A device failure outside a forward pass: the engine stops, fail-closed (as on one inside).
    pub(crate) fn device_failed(&mut self, e: &DeviceError) {
        tracing::error!(error = %e, "the CUDA device failed: the engine stops");
        self.audit_error = Some(format!("CUDA device failed: {e}"));
    }

    /// What released pages are overwritten with (see [`crate::kv::ReleaseFill`]).
    pub fn set_release_fill(&mut self, fill: crate::kv::ReleaseFill) {
        self.pool.set_release_fill(fill);
    }

    /// Record every page allocation, write, read and release, and every request's lifecycle, into
    /// `sink`. Without a sink nothing is recorded (audit off).
    pub fn with_audit(mut self, sink: Arc<dyn AuditSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Replace (or remove) the audit sink between requests (benchmarks compare audit on and off).
    pub fn set_audit(&mut self, sink: Option<Arc<dyn AuditSink>>) {
        self.sink = sink;
    }

    /// Why the engine stopped serving, if its audit sink failed.
    pub fn audit_error(&self) -> Option<&str> {
        self.audit_error.as_deref()
    }

    /// Record an event the engine's caller observed (a disaggregated node's transfers), through
    /// the same sink and with the same fail-closed rule.
    pub fn record(&mut self, ev: audit::Event) {
        self.emit(ev);
    }

    /// Whether this engine caches prefixes (`engine.prefix_cache`): requests' `cache` scopes
    /// are ignored otherwise.
    pub fn prefix_cache_enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// The prefix cache's counters (`None` when it is off).
    pub fn prefix_cache_stats(&self) -> Option<crate::prefix_cache::CacheStats> {
        self.cache.as_ref().map(PrefixCache::stats)
    }

    /// Whether a sink is attached (callers skip building events otherwise).
    pub fn auditing(&self) -> bool {
        self.sink.is_some()
    }

    fn emit(&mut self, ev: audit::Event) {
        if let Some(sink) = &self.sink
            && let Err(e) = sink.record(ev)
        {
            if self.audit_error.is_none() {
                tracing::error!(error = %e, "audit sink failed: the engine stops admitting and running work");
            }
            self.audit_error.get_or_insert(e.to_string());
        }
    }

    fn emit_request(
        &mut self,
        id: RequestId,
        tenant: &str,
        kind: RequestKind,
        prompt: usize,
        output: usize,
    ) {
        if self.sink.is_some() {
            let ev = audit::Event::Request {
                ts_ns: now_ns(),
                request: id,
                tenant: tenant.into(),
                kind,
                prompt_tokens: prompt as u32,
                output_tokens: output as u32,
            };
            self.emit(ev);
        }
    }

    fn emit_pages(&mut self, id: RequestId, tenant: &str, pages: &[PageRef], kind: PageKind) {
        if self.sink.is_some() {
            for pr in pages {
                let ev = audit::Event::Page {
                    ts_ns: now_ns(),
                    request: id,
                    tenant: tenant.into(),
                    page: pr.page,
                    generation: pr.generation,
                    kind,
                };
                self.emit(ev);
            }
        }
    }

    /// Write-ahead: the slots `start..start + n` of a sequence, split by page.
    fn emit_writes(
        &mut self,
        id: RequestId,
        tenant: &str,
        pages: &[PageRef],
        start: usize,
        n: usize,
    ) {
        if self.sink.is_none() || n == 0 {
            return;
        }
        let ps = self.pool.page_size();
        let mut pos = start;
        while pos < start + n {
            let idx = pos / ps;
            let end = ((idx + 1) * ps).min(start + n);
            if let Some(&pr) = pages.get(idx) {
                let kind = PageKind::Write {
                    slot_start: (pos - idx * ps) as u32,
                    slot_end: (end - idx * ps) as u32,
                    writer: audit::Writer::Local,
                };
                self.emit_pages(id, tenant, &[pr], kind);
            }
            pos = end;
        }
    }

    /// Flush a sequence's read runs, release its pages, and record how it ended.
    fn retire(&mut self, s: Seq, kind: RequestKind) {
        let out = s.generated;
        self.retire_as(s, kind, out);
    }

    /// [`Engine::retire`], recording `output_tokens` as the request's output (what its client
    /// received, at most what it produced).
    fn retire_as(&mut self, s: Seq, kind: RequestKind, output_tokens: usize) {
        debug_assert!(
            output_tokens <= s.generated,
            "request {}: more tokens delivered than produced",
            s.id
        );
        self.flush_reads(&s);
        self.release(&s);
        let out = output_tokens.min(s.generated);
        self.emit_request(s.id, &s.tenant, kind, s.prompt.len(), out);
    }

    fn flush_reads(&mut self, s: &Seq) {
        if self.sink.is_some() {
            for (idx, run) in s.reads.iter().enumerate() {
                if let (Some((slot_end, first_step, last_step)), Some(pr)) = (run, s.pages.get(idx))
                {
                    let ev = audit::Event::Read {
                        ts_ns: now_ns(),
                        request: s.id,
                        tenant: s.tenant.clone(),
                        page: pr.page,
                        generation: pr.generation,
                        slot_start: 0,
                        slot_end: *slot_end,
                        first_step: *first_step,
                        last_step: *last_step,
                        verified: self.tag_check == TagCheck::Enforced,
                    };
                    self.emit(ev);
                }
            }
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }
    /// The pool, read-only: geometry, counts and tags, and reads through a [`SendGrant`]
    /// only. Never a `&PagePool` (whose owner may mint grants) nor a `&mut`.
    ///
    /// [`SendGrant`]: crate::kv::SendGrant
    pub fn pool(&self) -> PoolView<'_> {
        self.pool.view()
    }
    pub fn context_length(&self) -> usize {
        self.context_length
    }
    /// Tokens one step computes at most (decode rows plus prefill chunks).
    pub fn max_batch_tokens(&self) -> usize {
        self.cfg.max_batch_tokens
    }
    /// The id the next `submit` will assign, accepted or rejected (a rejection is recorded under
    /// it too): the HTTP server returns it to the client before it knows the outcome.
    pub fn next_request_id(&self) -> RequestId {
        self.next_id
    }

    /// Admitted requests waiting for pages or a running slot.
    pub fn n_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests in prefill or decode.
    pub fn n_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Requests waiting or running (for a single node: 0 = pool fully free; the role wrappers
    /// add the sets they own).
    pub fn n_live(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.pool.page_size())
    }

    /// Admit or reject a request. Rejection happens before any page is allocated.
    pub fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, AdmissionError> {
        self.submit_as(req, Goal::Generate)
    }

    fn submit_as(
        &mut self,
        mut req: GenerateRequest,
        goal: Goal,
    ) -> Result<RequestId, AdmissionError> {
        if self.cache.is_none() {
            req.cache = None;
        }
        if let Some(e) = &self.audit_error {
            return Err(AdmissionError::AuditUnavailable(e.clone()));
        }
        let checked = self.check_admission(&req, goal);
        let id = self.next_id;
        self.next_id += 1;
        if let Err(e) = checked {
            self.emit_request(
                id,
                &req.tenant,
                RequestKind::Rejected {
                    reason: e.to_string(),
                },
                req.prompt.len(),
                0,
            );
            return Err(e);
        }
        self.emit_request(id, &req.tenant, RequestKind::Admitted, req.prompt.len(), 0);
        if self.sink.is_some()
            && let Some(r) = req.decoding.record(id, &req.tenant, now_ns())
        {
            self.emit(audit::Event::Decoding(Box::new(r)));
        }
        if let Some(e) = &self.audit_error {
            return Err(AdmissionError::AuditUnavailable(e.clone()));
        }
        let mut seq = Seq::new(id, req, goal);
        self.prefetch_for(&mut seq);
        self.waiting.push_back(seq);
        Ok(id)
    }

    fn check_admission(&self, req: &GenerateRequest, goal: Goal) -> Result<(), AdmissionError> {
        if req.prompt.is_empty() {
            return Err(AdmissionError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(AdmissionError::ZeroMaxTokens);
        }
        req.sampling
            .validate()
            .map_err(AdmissionError::BadSampling)?;
        let vocab = self.model.config.vocab_size;
        req.decoding
            .validate(vocab)
            .map_err(AdmissionError::BadDecoding)?;
        if let Some(&id) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(AdmissionError::BadToken { id, vocab });
        }
        let total = req.prompt.len().saturating_add(req.max_tokens);
        if total > self.context_length {
            return Err(AdmissionError::ContextExceeded {
                prompt_tokens: req.prompt.len(),
                max_tokens: req.max_tokens,
                context_length: self.context_length,
            });
        }
        let needed_pages = self.pages_for(if goal == Goal::PrefillOnly {
            req.prompt.len()
        } else {
            total
        });
        if needed_pages > self.pool.n_pages() {
            return Err(AdmissionError::ExceedsPool {
                needed_pages,
                pool_pages: self.pool.n_pages(),
            });
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(AdmissionError::QueueFull {
                max_waiting: self.cfg.max_waiting,
            });
        }
        Ok(())
    }

    /// Abort a request (waiting or running): recorded `aborted` with `reason` and the tokens
    /// it produced. Returns whether it existed.
    pub fn abort(&mut self, id: RequestId, reason: &str) -> bool {
        let kind = RequestKind::Aborted {
            reason: reason.into(),
        };
        self.end_early(id, kind, None)
    }

    /// End a request the engine has not finished (waiting or running) the way its caller — who
    /// answered the client — saw it end: `kind` (e.g. `finished`, reason `stop`, for a stop
    /// sequence the server matched in the text, which the engine cannot see) and
    /// `delivered_tokens`, the output tokens the client received (`None`: every token produced).
    /// Returns whether it existed.
    pub fn end_early(
        &mut self,
        id: RequestId,
        kind: RequestKind,
        delivered_tokens: Option<usize>,
    ) -> bool {
        let s = if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i)
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.swap_remove(i))
        } else {
            None
        };
        let Some(s) = s else {
            return false;
        };
        let out = delivered_tokens.unwrap_or(s.generated);
        self.retire_as(s, kind, out);
        true
    }

    /// Return a sequence's pages to the free list. Safety property 2 ("no early reuse") holds by
    /// construction here: a core sequence carries no transfer key — pages a remote writer may
    /// still write live in [`DecodeEngine`]'s importing and quarantined sets, which hand them
    /// back only with the transport's proof that the key is dead.
    fn release(&mut self, s: &Seq) {
        // Its cached pages stay in the cache (evicted when the pool needs them).
        if let Some(cache) = &mut self.cache {
            cache.release(&s.keys);
        }
        // Page by page: a page whose tag no longer proves it is ours is not returned to the free
        // list (leaked rather than reused — the safe direction).
        for pr in &s.pages[s.keys.len()..] {
            match self.pool.release(s.id, std::slice::from_ref(pr)) {
                Ok(()) => {
                    self.emit_pages(s.id, &s.tenant, std::slice::from_ref(pr), PageKind::Release)
                }
                Err(e) => {
                    // Kept out of circulation; recorded as quarantined.
                    tracing::error!(request = s.id, error = %e, "page not released: tag mismatch");
                    self.emit_pages(
                        s.id,
                        &s.tenant,
                        std::slice::from_ref(pr),
                        PageKind::Quarantine,
                    );
                }
            }
        }
    }

    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_running {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if self.awaits_prefetch(&s) {
                // In order: the head waits (briefly, bounded) for its pages to reach memory.
                self.waiting.push_front(s);
                break;
            }
            let total = self.pages_for(s.reserve_tokens());
            let mut hits = self.acquire_hits(&s);
            // Pages from the pool: restored ones and its own.
            let need = total - hits.len();
            let evictable = self.cache.as_ref().map_or(0, PrefixCache::evictable);
            if need > self.pool.n_free() + evictable {
                if let Some(cache) = &mut self.cache {
                    cache.release(&hits.iter().map(|h| h.key).collect::<Vec<_>>());
                }
                self.waiting.push_front(s);
                break;
            }
            self.evict_until_free(need);
            let restorable = self.restorable_for(&s, hits.len());
            if restorable > 0 {
                let parent = hits.last().map(|h| h.key);
                let restored = self.restore_for(&s, hits.len(), restorable, parent);
                hits.extend(restored);
            }
            self.prefetch_done(&mut s);
            let need = total - hits.len();
            match self.pool.alloc(s.id, need) {
                Ok(pages) => s.pages = pages,
                Err(e) => unreachable!("free and evictable pages checked above: {e}"),
            }
            let ps = self.pool.page_size();
            s.cached_tokens = hits.len() * ps;
            s.n_cached = s.cached_tokens;
            s.keys = hits.iter().map(|h| h.key).collect();
            let own = std::mem::take(&mut s.pages);
            s.pages = hits
                .iter()
                .map(|h| h.page)
                .chain(own.iter().copied())
                .collect();
            s.reads = vec![None; s.pages.len()];
            debug_assert!(
                s.n_cached < s.prompt.len(),
                "a hit leaves a token to compute"
            );
            let (id, tenant) = (s.id, s.tenant.clone());
            self.emit_hits(&s, &hits);
            self.running.push(s);
            self.emit_pages(id, &tenant, &own, PageKind::Alloc);
        }
    }

    /// The cached pages `s`'s prompt starts with, referenced for it (at most all but its last
    /// token's pages: that token's logits are its first output).
    fn acquire_hits(&mut self, s: &Seq) -> Vec<CachedPage> {
        let (Some(cache), Some(scope)) = (&mut self.cache, &s.cache) else {
            return Vec::new();
        };
        #[cfg(feature = "fault-injection")]
        let scope = self.fault_lookup_scope.as_ref().unwrap_or(scope);
        let ps = self.pool.page_size();
        let chain = scope.chain(&s.prompt, ps, (s.prompt.len() - 1) / ps);
        let n = cache.lookup(&chain);
        cache.acquire(&chain, n)
    }

    /// Evict unheld cached pages (least recently used leaves first) until `need` pages are
    /// free or nothing more can be evicted; each returns to the pool's free list.
    fn evict_until_free(&mut self, need: usize) {
        while self.pool.n_free() < need {
            let Some(ev) = self.cache.as_mut().and_then(PrefixCache::evict_one) else {
                break;
            };
            self.write_back(&ev);
            let released = self
                .pool
                .release(ev.tag.get(), std::slice::from_ref(&ev.page));
            let kind = match released {
                Ok(()) => PageKind::Release,
                Err(e) => {
                    tracing::error!(page = ev.page.page, error = %e, "cached page not released: tag mismatch");
                    PageKind::Quarantine
                }
            };
            self.emit_cache(
                audit::CacheEvent::Evict,
                ev.writer,
                &ev.writer_tenant,
                &ev,
                0,
            );
            self.emit_pages(ev.writer, &ev.writer_tenant, &[ev.page], kind);
        }
    }

    /// One `prefix_cache` row.
    fn emit_cache(
        &mut self,
        event: audit::CacheEvent,
        request: RequestId,
        tenant: &Arc<str>,
        page: &CachedPage,
        hit_tokens: usize,
    ) {
        if self.sink.is_none() {
            return;
        }
        let scope_kind = match page.kind {
            ScopeKind::Tenant => "tenant",
            ScopeKind::Public => "public",
            ScopeKind::UnsafeGlobal => "unsafe",
        };
        self.emit(audit::Event::Cache(Box::new(audit::CacheRecord {
            ts_ns: now_ns(),
            event,
            request,
            tenant: tenant.clone(),
            page: page.page.page,
            generation: page.page.generation,
            namespace: page.tag.get(),
            scope: page.scope.clone(),
            scope_kind,
            writer: page.writer,
            writer_tenant: page.writer_tenant.clone(),
            hit_tokens: hit_tokens as u32,
        })));
    }

    fn emit_hits(&mut self, s: &Seq, hits: &[CachedPage]) {
        for h in hits {
            self.emit_cache(audit::CacheEvent::Hit, s.id, &s.tenant, h, s.cached_tokens);
        }
    }

    /// Hand `running[i]`'s newly full pages to their namespaces, extending its chain: only its
    /// own pages written whole (the pool checks), in order, while no other writer cached the
    /// same key first.
    fn publish(&mut self, i: usize) {
        let ps = self.pool.page_size();
        let s = &self.running[i];
        let full = s.n_cached / ps;
        if !s.publishing || full <= s.keys.len() {
            return;
        }
        let Some(scope) = s.cache.clone() else {
            return;
        };
        let written: Vec<u32> = s
            .prompt
            .iter()
            .chain(&s.output)
            .take(full * ps)
            .copied()
            .collect();
        // Only the new links: the chain so far is the sequence's own keys.
        let from = s.keys.len();
        let chain = scope.links(&written, ps, s.keys.last().copied(), from..full);
        // Under the unsafe token-only reproduction the offload tiers key pages on tokens alone.
        let offload_keys = self
            .offload
            .as_ref()
            .filter(|o| o.token_only())
            .map(|_| crate::prefix_cache::token_only_keys(&written, ps, full));
        let (id, tenant) = (s.id, s.tenant.clone());
        let mut shared = Vec::new();
        for (idx, &link) in (from..full).zip(&chain) {
            let Some(cache) = &mut self.cache else { break };
            if cache.contains(&link.key) {
                self.running[i].publishing = false;
                break;
            }
            let pr = self.running[i].pages[idx];
            if let Err(e) = self.pool.share(id, &[pr], link.namespace.tag()) {
                tracing::error!(request = id, error = %e, "page not shared");
                self.running[i].publishing = false;
                break;
            }
            let page = CachedPage {
                key: link.key,
                page: pr,
                tag: link.namespace.tag(),
                scope: link.namespace.label().clone(),
                kind: link.namespace.kind().clone(),
                writer: id,
                writer_tenant: tenant.clone(),
                writer_node: None,
                offload_key: offload_keys.as_ref().map_or(link.key, |k| k[idx]),
            };
            // Its parent is its own previous link, cached and held by it.
            cache.insert(page.clone(), self.running[i].keys.last().copied());
            self.running[i].keys.push(link.key);
            shared.push(page);
        }
        for page in &shared {
            self.emit_cache(audit::CacheEvent::Share, id, &tenant, page, 0);
        }
    }

    /// Run one batch. Returns the events it produced (empty when idle).
    pub fn step(&mut self) -> Vec<Event> {
        let out = self.step_collect();
        // Only `PrefillEngine` admits prefill-only requests.
        debug_assert!(
            out.prefilled.is_empty(),
            "a core engine holds no prefilled KV"
        );
        out.events
    }

    fn step_collect(&mut self) -> StepOutput {
        let idle = |events: Vec<Event>| StepOutput {
            events,
            prefilled: Vec::new(),
        };
        if self.audit_error.is_some() {
            return idle(self.abort_all());
        }
        self.record_offload();
        self.admit();
        if self.running.is_empty() {
            if self.waiting.front().is_some_and(|s| s.prefetch.is_some()) {
                self.wait_for_offload();
            }
            return idle(Vec::new());
        }
        self.step_no = self.step_no.wrapping_add(1);
        // Plan: (running index, input tokens, start position, wants logits).
        let mut budget = self.cfg.max_batch_tokens;
        let mut plan: Vec<(usize, Vec<u32>, usize, bool)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if let Phase::Decode { next_input } = s.phase {
                if budget == 0 {
                    break;
                }
                plan.push((i, vec![next_input], s.n_cached, true));
                budget -= 1;
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if s.phase == Phase::Prefill && budget > 0 {
                let end = (s.n_cached + budget).min(s.prompt.len());
                let chunk = s.prompt[s.n_cached..end].to_vec();
                budget -= chunk.len();
                plan.push((i, chunk, s.n_cached, end == s.prompt.len()));
            }
        }
        debug_assert!(!plan.is_empty());
        // Write-ahead: the slots this step writes are recorded before they are written.
        for (i, toks, start, _) in &plan {
            let (id, tenant, pages) = (
                self.running[*i].id,
                self.running[*i].tenant.clone(),
                self.running[*i].pages.clone(),
            );
            self.emit_writes(id, &tenant, &pages, *start, toks.len());
        }
        if self.audit_error.is_some() {
            return idle(self.abort_all());
        }
        let segments: Vec<Segment<'_>> = plan
            .iter()
            .map(|(i, toks, start, want)| Segment {
                tokens: toks,
                start_pos: *start,
                block_table: &self.running[*i].pages,
                reader: self.running[*i].reader(),
                logits: if *want { Logits::Last } else { Logits::None },
                order: match self.running[*i].phase {
                    // As llama.cpp: a multi-token prompt is a matrix product, a lone token a dot.
                    Phase::Prefill if self.running[*i].prompt.len() >= 2 => ReduceOrder::Gemm,
                    Phase::Prefill | Phase::Decode { .. } => ReduceOrder::Vec,
                },
                rows: match self.running[*i].phase {
                    Phase::Prefill => Rows::Prompt {
                        len: self.running[*i].prompt.len(),
                        chunk: self.cfg.max_batch_tokens,
                    },
                    Phase::Decode { .. } => Rows::Decode,
                },
                check: self.tag_check,
            })
            .collect();
        let results = run_forward(&mut self.compute, &self.model, &mut self.pool, &segments);
        drop(segments);
        let mut results = match results {
            Ok(r) => r,
            Err(e) => {
                // Not one request's fault: the engine stops (fail-closed, as when the audit
                // sink fails), aborting everything it holds.
                tracing::error!(error = %e, "the CUDA device failed: the engine stops");
                self.audit_error = Some(format!("CUDA device failed: {e}"));
                return idle(self.abort_all());
            }
        };
        let wants: Vec<(usize, bool)> = plan.iter().map(|p| (p.0, p.3)).collect();
        let mut shape_errors = shape_logits(&mut self.running, &wants, &mut results);

        let mut events = Vec::new();
        let mut done = Vec::new();
        let mut held = Vec::new();
        let mut violations = Vec::new();
        let mut grew = Vec::new();
        let ps = self.pool.page_size();
        let step_no = self.step_no;
        for (((i, toks, _, want), res), shaped) in
            plan.into_iter().zip(results).zip(shape_errors.iter_mut())
        {
            let s = &mut self.running[i];
            match res {
                Err(error) => {
                    tracing::warn!(request = s.id, %error, "request failed the integrity check");
                    violations.push((s.id, s.tenant.clone(), error.clone()));
                    events.push(Event::Failed { id: s.id, error });
                    done.push((
                        i,
                        RequestKind::Failed {
                            reason: "integrity".into(),
                        },
                    ));
                }
                Ok(logits) => {
                    s.n_cached += toks.len();
                    if s.publishing {
                        grew.push(i);
                    }
                    // Every slot 0..n_cached was attended (and tag-checked) in this step.
                    for (idx, run) in s.reads.iter_mut().enumerate().take(s.n_cached.div_ceil(ps)) {
                        let end = (s.n_cached - idx * ps).min(ps) as u32;
                        *run = Some(match *run {
                            Some((e, first, _)) => (e.max(end), first, step_no),
                            None => (end, step_no, step_no),
                        });
                    }
                    if !want {
                        continue;
                    }
                    let picked = match shaped.take().map_or_else(|| s.choose(logits), Err) {
                        Ok(p) => p,
                        Err(e) => {
                            // A constraint with no way on (the library's error): this request
                            // ends with the reason, the batch goes on.
                            tracing::warn!(request = s.id, error = %e, "output constraint failed");
                            events.push(Event::Aborted {
                                id: s.id,
                                reason: e.to_string(),
                            });
                            done.push((
                                i,
                                RequestKind::Failed {
                                    reason: "constraint".into(),
                                },
                            ));
                            continue;
                        }
                    };
                    let tok = picked.token;
                    if s.goal == Goal::PrefillOnly {
                        events.push(Event::Prefilled {
                            id: s.id,
                            first_token: tok,
                            first_logprobs: picked.logprobs,
                            cached_tokens: s.cached_tokens,
                        });
                        held.push(i);
                        continue;
                    }
                    // A complete constraint ends the output as a stop token would.
                    let stop = picked.stop || s.decode.complete();
                    if !picked.stop {
                        s.generated += 1;
                        s.output.push(tok);
                        events.push(Event::Token {
                            id: s.id,
                            token: tok,
                            logprobs: picked.logprobs,
                        });
                    }
                    if stop || s.generated >= s.max_tokens {
                        let reason = if stop {
                            FinishReason::Stop
                        } else {
                            FinishReason::Length
                        };
                        events.push(Event::Finished {
                            id: s.id,
                            reason,
                            prompt_tokens: s.prompt.len(),
                            generated_tokens: s.generated,
                            cached_tokens: s.cached_tokens,
                        });
                        let why = if stop { "stop" } else { "length" };
                        done.push((i, RequestKind::Finished { reason: why.into() }));
                    } else {
                        s.phase = Phase::Decode { next_input: tok };
                    }
                }
            }
        }
        for i in grew {
            self.publish(i);
        }
        for (id, tenant, error) in violations {
            let (page, generation) = violation_page(&error);
            let kind = format!("{error:?}")
                .split([' ', '{'])
                .next()
                .unwrap_or("Integrity")
                .to_owned();
            self.emit(audit::Event::IntegrityViolation {
                ts_ns: now_ns(),
                request: id,
                tenant,
                page,
                generation,
                kind,
                detail: error.to_string(),
            });
        }
        // Remove finished and held sequences from `running`, highest index first.
        let mut leaving: Vec<(usize, Option<RequestKind>)> = done
            .into_iter()
            .map(|(i, k)| (i, Some(k)))
            .chain(held.into_iter().map(|i| (i, None)))
            .collect();
        leaving.sort_unstable_by_key(|(i, _)| *i);
        let mut prefilled = Vec::new();
        for (i, kind) in leaving.into_iter().rev() {
            let s = self.running.remove(i);
            match kind {
                Some(kind) => self.retire(s, kind),
                None => prefilled.push(s),
            }
        }
        StepOutput { events, prefilled }
    }

    /// Audit failure: stop everything, emitting no further tokens.
    fn abort_all(&mut self) -> Vec<Event> {
        let reason = self.audit_abort_reason();
        let mut events = Vec::new();
        let all: Vec<Seq> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for s in all {
            events.push(Event::Aborted {
                id: s.id,
                reason: reason.clone(),
            });
            self.release(&s);
        }
        events
    }

    /// Why work stops after an audit failure (the reason every aborted request carries).
    fn audit_abort_reason(&self) -> String {
        format!(
            "audit log unavailable: {}",
            self.audit_error.clone().unwrap_or_default()
        )
    }

    /// Teacher-forced scoring: logits (`tokens.len() × vocab`) at every position of `tokens`,
    /// computed through the same paged path (pages allocated, checked and released).
    pub fn score(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ScoreError> {
        if tokens.is_empty() || tokens.len() > self.context_length {
            return Err(ScoreError::Length {
                tokens: tokens.len(),
                context_length: self.context_length,
            });
        }
        let owner = self.next_id;
        self.next_id += 1;
        let pages = self
            .pool
            .alloc(owner, self.pages_for(tokens.len()))
            .map_err(ScoreError::Pool)?;
        self.emit_pages(owner, "score", &pages, PageKind::Alloc);
        self.emit_writes(owner, "score", &pages, 0, tokens.len());
        let mut out = Vec::with_capacity(tokens.len() * self.model.config.vocab_size);
        let mut result = Ok(());
        for (ci, chunk) in tokens.chunks(self.cfg.max_batch_tokens).enumerate() {
            let seg = Segment {
                tokens: chunk,
                start_pos: ci * self.cfg.max_batch_tokens,
                block_table: &pages,
                reader: Reader::private(owner),
                logits: Logits::All,
                order: ReduceOrder::Gemm,
                rows: Rows::Prompt {
                    len: tokens.len(),
                    chunk: self.cfg.max_batch_tokens,
                },
                check: TagCheck::Enforced,
            };
            match run_forward(&mut self.compute, &self.model, &mut self.pool, &[seg])
                .map(|mut r| r.pop())
            {
                Ok(Some(Ok(l))) => out.extend_from_slice(&l),
                Ok(Some(Err(e))) => {
                    result = Err(ScoreError::Integrity(e));
                    break;
                }
                Ok(None) => unreachable!("one segment in, one result out"),
                Err(e) => {
                    result = Err(ScoreError::Device(e.to_string()));
                    break;
                }
            }
        }
        let s = Seq {
            id: owner,
            prompt: tokens.to_vec(),
            max_tokens: 0,
            stop_ids: Vec::new(),
            sampler: Sampler::new(SamplingParams::default()),
            decode: DecodeState::default(),
            reads: (0..pages.len())
                .map(|i| {
                    Some((
                        (tokens.len() - i * self.pool.page_size()).min(self.pool.page_size())
                            as u32,
                        0,
                        0,
                    ))
                })
                .collect(),
            pages,
            n_cached: tokens.len(),
            generated: 0,
            phase: Phase::Prefill,
            tenant: "score".into(),
            goal: Goal::Generate,
            cache: None,
            keys: Vec::new(),
            publishing: false,
            cached_tokens: 0,
            output: Vec::new(),
            prefetch: None,
        };
        self.retire(
            s,
            RequestKind::Finished {
                reason: "score".into(),
            },
        );
        result.map(|()| out)
    }

    /// Fault injection (feature `fault-injection`, tests only): corrupt engine state the way
    /// the incident's bugs did, to prove the integrity check catches it.
    #[cfg(feature = "fault-injection")]
    pub fn fault_injection(&mut self) -> FaultInjector<'_> {
        FaultInjector { engine: self }
    }
}

fn now_ns() -> u64 {
    custody_audit::mono_now_ns()
}

/// The page (and generation) an integrity error names, for the violation record.
fn violation_page(e: &IntegrityError) -> (Option<u32>, Option<u32>) {
    match *e {
        IntegrityError::PageOutOfRange { page, .. } => (Some(page), None),
        IntegrityError::BlockTableTooShort { .. } => (None, None),
        IntegrityError::StaleGeneration { page, found, .. } => (Some(page), Some(found)),
        IntegrityError::ForeignOwner {
            page, generation, ..
        } => (Some(page), Some(generation)),
        IntegrityError::UnwrittenSlot {
            page, generation, ..
        } => (Some(page), Some(generation)),
        IntegrityError::OutOfOrderWrite { page, .. } => (Some(page), None),
        IntegrityError::InBandMismatch {
            page, generation, ..
        } => (Some(page), Some(generation)),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    #[error("cannot score {tokens} tokens with context length {context_length}")]
    Length {
        tokens: usize,
        context_length: usize,
    },
    #[error(transparent)]
    Pool(PoolError),
    #[error(transparent)]
    Integrity(IntegrityError),
    #[error("the CUDA device failed: {0}")]
    Device(String),
}

/// See `Engine::fault_injection` (feature `fault-injection`).
#[cfg(feature = "fault-injection")]
#[derive(Debug)]
pub struct FaultInjector<'a> {
    engine: &'a mut Engine,
}

#[cfg(feature = "fault-injection")]
impl FaultInjector<'_> {
    fn seq(&mut self, id: RequestId) -> &mut Seq {
        self.engine
            .running
            .iter_mut()
            .find(|s| s.id == id)
            .unwrap_or_else(|| panic!("request {id} is not running"))
    }

    /// The page behind logical page `idx` of request `id` is reallocated under it (its tag
    /// generation moves on, as if released and handed out again).
    pub fn reallocate_page(&mut self, id: RequestId, idx: usize) {
        let pr = self.seq(id).pages[idx];
        let tag = self.engine.pool.tag(pr.page);
        self.engine
            .pool
            .fault_inject_set_tag(pr.page, tag.generation.wrapping_add(1), tag.owner);
    }

    /// Every later cache lookup uses `scope` instead of the request's own: an index that hands a
    /// request another namespace's pages. The read's tag check must still refuse them.
    pub fn misdirect_cache_lookups(&mut self, scope: CacheScope) {
        self.engine.fault_lookup_scope = Some(scope);
    }

    /// Request `id`'s logical page `idx` is pointed at a page that belongs to request `victim`
    /// (with that page's current generation) — a block-table mix-up.
    pub fn point_at_foreign_page(&mut self, id: RequestId, idx: usize, victim: RequestId) {
        let foreign = self.seq(victim).pages[idx];
        self.seq(id).pages[idx] = foreign;
    }

    /// Request `id` advances `n` positions without writing their KV (the incident's "1-token
    /// placeholder": the sequence believes slots are filled that nobody wrote).
    pub fn skip_positions(&mut self, id: RequestId, n: usize) {
        self.seq(id).n_cached += n;
    }

    /// Position (KV slots written) of running request `id`.
    pub fn position(&mut self, id: RequestId) -> usize {
        self.seq(id).n_cached
    }
}

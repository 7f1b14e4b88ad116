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

use custody_kernels::attention::{IntegrityError, PageRef, ReduceOrder};

use crate::config::EngineConfig;
use crate::kv::{PagePool, PoolError};
use crate::model::{Logits, Model, Scratch, Segment};
use crate::sampling::{Sampler, SamplingParams};

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
    BadSampling(String),
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
}

/// A generation request over token ids.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end generation (not emitted).
    pub stop_ids: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` were produced.
    Length,
}

/// What a step produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Token {
        id: RequestId,
        token: u32,
    },
    Finished {
        id: RequestId,
        reason: FinishReason,
        prompt_tokens: usize,
        generated_tokens: usize,
    },
    Failed {
        id: RequestId,
        error: IntegrityError,
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
    pages: Vec<PageRef>,
    /// Slots whose KV this sequence has written (its next position).
    n_cached: usize,
    generated: usize,
    phase: Phase,
}

/// The single-node engine. Not `Sync`: one scheduler thread drives it; kernels parallelise inside.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    pool: PagePool,
    cfg: EngineConfig,
    context_length: usize,
    next_id: RequestId,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    scratch: Scratch,
}

impl Engine {
    /// Size the pool from the memory budget and check it against the context length.
    pub fn new(model: Model, cfg: EngineConfig) -> Result<Self, StartupError> {
        cfg.validate()?;
        let model_ctx = model.config.context_length;
        let mut context_length = cfg.context_length.unwrap_or(model_ctx);
        if context_length > model_ctx {
            return Err(StartupError::ContextBeyondModel {
                configured: context_length,
                model: model_ctx,
            });
        }
        let geom = model.page_geometry(cfg.page_size);
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
        if pool_tokens < context_length {
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
        let pool = PagePool::new(geom, model.config.n_layers, n_pages);
        Ok(Self {
            model,
            pool,
            cfg,
            context_length,
            next_id: 1,
            waiting: VecDeque::new(),
            running: Vec::new(),
            scratch: Scratch::default(),
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }
    pub fn context_length(&self) -> usize {
        self.context_length
    }
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.pool.page_size())
    }

    /// Admit or reject a request. Rejection happens before any page is allocated.
    pub fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, AdmissionError> {
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
        let needed_pages = self.pages_for(total);
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
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id,
            prompt: req.prompt,
            max_tokens: req.max_tokens,
            stop_ids: req.stop_ids,
            sampler: Sampler::new(req.sampling),
            pages: Vec::new(),
            n_cached: 0,
            generated: 0,
            phase: Phase::Prefill,
        });
        Ok(id)
    }

    /// Abort a request (waiting or running). Returns whether it existed.
    pub fn abort(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.swap_remove(i);
            self.release(&s);
            return true;
        }
        false
    }

    fn release(&mut self, s: &Seq) {
        // Page by page: a page whose tag no longer proves it is ours is not returned to the free
        // list (leaked rather than reused — the safe direction).
        for pr in &s.pages {
            if let Err(e @ PoolError::BadRelease { .. }) =
                self.pool.release(s.id, std::slice::from_ref(pr))
            {
                tracing::error!(request = s.id, error = %e, "page not released: tag mismatch");
            }
        }
    }

    fn admit(&mut self) {
        while let Some(front) = self.waiting.front() {
            if self.running.len() >= self.cfg.max_running {
                break;
            }
            let need = self.pages_for(front.prompt.len() + front.max_tokens);
            if need > self.pool.n_free() {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            match self.pool.alloc(s.id, need) {
                Ok(pages) => s.pages = pages,
                Err(e) => unreachable!("free pages checked above: {e}"),
            }
            self.running.push(s);
        }
    }

    /// Run one batch. Returns the events it produced (empty when idle).
    pub fn step(&mut self) -> Vec<Event> {
        self.admit();
        if self.running.is_empty() {
            return Vec::new();
        }
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
        let segments: Vec<Segment<'_>> = plan
            .iter()
            .map(|(i, toks, start, want)| Segment {
                tokens: toks,
                start_pos: *start,
                block_table: &self.running[*i].pages,
                owner: self.running[*i].id,
                logits: if *want { Logits::Last } else { Logits::None },
                order: match self.running[*i].phase {
                    // As llama.cpp: a multi-token prompt is a matrix product, a lone token a dot.
                    Phase::Prefill if self.running[*i].prompt.len() >= 2 => ReduceOrder::Gemm,
                    Phase::Prefill | Phase::Decode { .. } => ReduceOrder::Vec,
                },
            })
            .collect();
        let results = self
            .model
            .forward(&mut self.pool, &segments, &mut self.scratch);
        drop(segments);

        let mut events = Vec::new();
        let mut done = Vec::new();
        for ((i, toks, _, want), res) in plan.into_iter().zip(results) {
            let s = &mut self.running[i];
            match res {
                Err(error) => {
                    tracing::warn!(request = s.id, %error, "request failed the integrity check");
                    events.push(Event::Failed { id: s.id, error });
                    done.push(i);
                }
                Ok(logits) => {
                    s.n_cached += toks.len();
                    if !want {
                        continue;
                    }
                    let tok = s.sampler.sample(&logits);
                    let stop = s.stop_ids.contains(&tok);
                    if !stop {
                        s.generated += 1;
                        events.push(Event::Token {
                            id: s.id,
                            token: tok,
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
                        });
                        done.push(i);
                    } else {
                        s.phase = Phase::Decode { next_input: tok };
                    }
                }
            }
        }
        done.sort_unstable();
        for i in done.into_iter().rev() {
            let s = self.running.remove(i);
            self.release(&s);
        }
        events
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
        let mut out = Vec::with_capacity(tokens.len() * self.model.config.vocab_size);
        let mut result = Ok(());
        for (ci, chunk) in tokens.chunks(self.cfg.max_batch_tokens).enumerate() {
            let seg = Segment {
                tokens: chunk,
                start_pos: ci * self.cfg.max_batch_tokens,
                block_table: &pages,
                owner,
                logits: Logits::All,
                order: ReduceOrder::Gemm,
            };
            match self
                .model
                .forward(&mut self.pool, &[seg], &mut self.scratch)
                .pop()
            {
                Some(Ok(l)) => out.extend_from_slice(&l),
                Some(Err(e)) => {
                    result = Err(ScoreError::Integrity(e));
                    break;
                }
                None => unreachable!("one segment in, one result out"),
            }
        }
        if let Err(e) = self.pool.release(owner, &pages) {
            tracing::error!(error = %e, "score: pages not released");
        }
        result.map(|()| out)
    }

    /// Fault injection for tests (named as such): corrupt engine state the way the incident's
    /// bugs did, to prove the integrity check catches it.
    pub fn fault_injection(&mut self) -> FaultInjector<'_> {
        FaultInjector { engine: self }
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
}

/// See [`Engine::fault_injection`].
#[derive(Debug)]
pub struct FaultInjector<'a> {
    engine: &'a mut Engine,
}

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
        let (generation, owner, _) = self.engine.pool.tag(pr.page);
        self.engine
            .pool
            .fault_inject_set_tag(pr.page, generation.wrapping_add(1), owner);
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

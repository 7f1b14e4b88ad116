//! Output constraints — any JSON object, a JSON schema, a Lark grammar or a regular expression —
//! enforced token by token with `llguidance` (the library mistral.rs uses and llama.cpp and vLLM
//! offer as a backend): before each sampled token the constraint's mask sends every token it
//! does not allow to −∞, and the sampled token advances it.
//!
//! Compiling a constraint can take milliseconds to seconds: [`Grammars::compile`] is called
//! where the request is parsed (the server's blocking pool, a decode node's handler), never on
//! the engine thread. Masks are computed ahead, while the forward pass runs ([`ahead`]). A
//! constraint that cannot compile is the caller's error, with the library's message.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use sha2::{Digest, Sha256};

use crate::tokenizer::Tokenizer;

pub mod ahead;

/// Longest accepted schema, grammar or expression, bytes.
pub const MAX_CONSTRAINT_BYTES: usize = 256 * 1024;
/// Deepest accepted nesting of a JSON schema document (objects and arrays): past it the schema
/// is refused before it is compiled (the compiler recurses over it).
pub const MAX_SCHEMA_DEPTH: usize = 64;

/// What kind of constraint a request asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConstraintKind {
    /// `response_format: {"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `response_format: {"type": "json_schema", ...}`: the schema's documents.
    JsonSchema,
    /// A Lark grammar (llguidance's dialect, which also takes JSON schemas and regexes inline).
    Lark,
    /// A regular expression the whole output must match.
    Regex,
    /// The tool-call grammar of a request with `tools` (`tools::tool_grammar`, Lark).
    ToolCalls,
}

impl ConstraintKind {
    /// The name recorded in the audit log and shown in errors.
    pub fn name(self) -> &'static str {
        match self {
            Self::JsonObject => "json_object",
            Self::JsonSchema => "json_schema",
            Self::Lark => "lark",
            Self::Regex => "regex",
            Self::ToolCalls => "tool_calls",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::JsonObject,
            Self::JsonSchema,
            Self::Lark,
            Self::Regex,
            Self::ToolCalls,
        ]
        .into_iter()
        .find(|k| k.name() == name)
    }
}

/// A constraint as the client gave it: its kind and its text (the schema as JSON, the grammar,
/// the expression; empty for `json_object`). What travels between nodes and what the audit
/// log's hash is of.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConstraintSpec {
    pub kind: ConstraintKind,
    pub source: String,
}

impl ConstraintSpec {
    /// SHA-256 of `kind name ‖ 0x00 ‖ source`, lower-case hex: what the audit log records, so
    /// that a client holding its schema can find its requests without the log holding it.
    pub fn sha256_hex(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.kind.name().as_bytes());
        h.update([0u8]);
        h.update(self.source.as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Why a constraint was refused or stopped a generation.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("the vocabulary cannot be used for constrained decoding: {0}")]
    Vocabulary(String),
    #[error("the {kind} is {bytes} bytes, over the limit of {limit}")]
    TooLarge {
        kind: &'static str,
        bytes: usize,
        limit: usize,
    },
    #[error("the JSON schema nests deeper than {limit} levels")]
    TooDeep { limit: usize },
    #[error("the JSON schema is not valid JSON: {0}")]
    SchemaJson(String),
    #[error("the JSON schema must be a JSON object or a boolean")]
    SchemaNotObject,
    #[error("cannot compile the {kind}: {message}")]
    Compile { kind: &'static str, message: String },
    #[error("the output constraint failed: {0}")]
    Step(String),
    #[error("the model names no end-of-text token")]
    NoEndOfText,
}

/// The vocabulary as llguidance sees it: every token's bytes in a trie (special tokens marked
/// with its 0xFF prefix, so no text spells them), and our own tokenizer for text it tokenizes.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// llguidance tokenizes text that continues the output (forced bytes, a grammar's
    /// literals): the tokens must spell exactly `s`, or a token it forces is one the parser
    /// then rejects. So: our tokenizer as a continuation (no SentencePiece space prefix), kept
    /// only if the trie spells `s` from it; otherwise (bytes that are not UTF-8, text that our
    /// tokenizer reads as a special token) the trie's greedy split, which always spells `s`.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let ours = std::str::from_utf8(s)
            .ok()
            .and_then(|text| self.tokenizer.encode_continuation(text).ok());
        match ours {
            Some(ids) if self.trie.decode_raw(&ids) == s => ids,
            _ => self.trie.greedy_tokenize(s),
        }
    }
}

/// The compiler for one model's vocabulary: built once at startup (the token trie), shared by
/// every request.
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl fmt::Debug for Grammars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammars")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

impl Grammars {
    /// Over `tokenizer`'s vocabulary, ending with its end-of-text token (else its first stop
    /// token).
    pub fn for_tokenizer(tokenizer: Arc<Tokenizer>) -> Result<Self, GrammarError> {
        let eos = tokenizer
            .eos_id
            .or_else(|| tokenizer.stop_ids.first().copied())
            .ok_or(GrammarError::NoEndOfText)?;
        Self::new(tokenizer, eos)
    }

    /// `eos`: the token a finished constraint allows (the model's end of turn or of text).
    pub fn new(tokenizer: Arc<Tokenizer>, eos: u32) -> Result<Self, GrammarError> {
        let n = tokenizer.vocab_size();
        let mut words = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let t = tokenizer
                .token_bytes(id)
                .ok_or_else(|| GrammarError::Vocabulary(format!("token {id} has no text")))?;
            let mut w = Vec::with_capacity(t.bytes.len() + 1);
            if t.special {
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
            }
            w.extend_from_slice(&t.bytes);
            words.push(w);
        }
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(VocabEnv { trie, tokenizer });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        // Errors come back as values; nothing is printed.
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// Compile `spec` for one generation.
    pub fn compile(&self, spec: ConstraintSpec) -> Result<Constraint, GrammarError> {
        let kind = spec.kind.name();
        if spec.source.len() > MAX_CONSTRAINT_BYTES {
            return Err(GrammarError::TooLarge {
                kind,
                bytes: spec.source.len(),
                limit: MAX_CONSTRAINT_BYTES,
            });
        }
        let grammar = match spec.kind {
            ConstraintKind::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            ConstraintKind::JsonSchema => {
                let schema: serde_json::Value = serde_json::from_str(&spec.source)
                    .map_err(|e| GrammarError::SchemaJson(e.to_string()))?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(GrammarError::SchemaNotObject);
                }
                if depth(&schema) > MAX_SCHEMA_DEPTH {
                    return Err(GrammarError::TooDeep {
                        limit: MAX_SCHEMA_DEPTH,
                    });
                }
                TopLevelGrammar::from_json_schema(compact(schema))
            }
            ConstraintKind::Lark | ConstraintKind::ToolCalls => {
                TopLevelGrammar::from_lark(spec.source.clone())
            }
            ConstraintKind::Regex => TopLevelGrammar::from_regex(&spec.source),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Compile {
                kind,
                message: e.to_string(),
            })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(message) = matcher.get_error() {
            return Err(GrammarError::Compile { kind, message });
        }
        Ok(Constraint::at(Arc::new(spec), matcher))
    }
}

/// JSON as one line with `", "` and `": "` between items, no other whitespace: a free
/// whitespace rule lets a weak model pad the output until `max_tokens`. A schema's own
/// `x-guidance` options win.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// Nesting depth of a JSON value (a scalar is 0), iteratively: the input is untrusted.
fn depth(v: &serde_json::Value) -> usize {
    let mut max = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        max = max.max(d);
        match v {
            serde_json::Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            serde_json::Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    max
}

/// One generation's compiled constraint and where it stands.
///
/// Its next mask is computed ahead ([`ahead`]): started when a token is accepted, awaited when
/// the next logits are masked. The matcher is shared with that job through a mutex; the
/// constraint's own methods lock it only where the job is done or was never started.
pub struct Constraint {
    /// What the mask jobs share with it. (Two pointers in all: requests move through bounded
    /// queues.)
    core: Arc<Core>,
    /// The mask at the current position, started on the mask pool; `None` when none was
    /// started (computed on demand).
    ahead: Option<Box<Ahead>>,
}

struct Core {
    spec: Arc<ConstraintSpec>,
    matcher: Mutex<Matcher>,
    /// The matcher is stopped: only the end-of-generation token may follow. Written under the
    /// matcher's lock by the constraint's own `advance`, read without it.
    stopped: AtomicBool,
}

impl Clone for Constraint {
    /// An independent copy at the same position (each of a request's choices advances its own).
    fn clone(&self) -> Self {
        let copy = lock(&self.core.matcher).deep_clone();
        Self::at(self.core.spec.clone(), copy)
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("kind", &self.core.spec.kind)
            .field("sha256", &self.core.spec.sha256_hex())
            .field("stopped", &self.is_complete())
            .finish()
    }
}

/// A mask started on the mask pool. Whoever sets `claimed` first computes it: the job, or
/// the step that needs it before the job has started.
struct Ahead {
    claimed: Arc<AtomicBool>,
    /// The job's answer. In a mutex only so that the constraint is `Sync` (requests are
    /// shared across threads by reference); never contended.
    rx: Mutex<Receiver<Result<SimpleVob, String>>>,
}

/// The matcher, whatever a panicked mask job left: the job's waiter reports that panic, and a
/// matcher that failed is in its error state, which every later call reports.
fn lock(m: &Mutex<Matcher>) -> std::sync::MutexGuard<'_, Matcher> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Constraint {
    /// A constraint at `matcher`'s position, its first mask started ahead.
    fn at(spec: Arc<ConstraintSpec>, matcher: Matcher) -> Self {
        let stopped = AtomicBool::new(matcher.is_stopped());
        let mut c = Self {
            core: Arc::new(Core {
                spec,
                matcher: Mutex::new(matcher),
                stopped,
            }),
            ahead: None,
        };
        c.start_ahead();
        c
    }

    pub fn spec(&self) -> &ConstraintSpec {
        &self.core.spec
    }

    /// Starts computing the mask at the current position on the mask pool (not when stopped:
    /// that mask is the end token alone, computed at once).
    fn start_ahead(&mut self) {
        debug_assert!(self.ahead.is_none(), "one mask ahead at a time");
        if self.is_complete() {
            return;
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let claimed = Arc::new(AtomicBool::new(false));
        let (core, job_claimed) = (self.core.clone(), claimed.clone());
        let job: ahead::Job = Box::new(move || {
            if job_claimed.swap(true, Ordering::AcqRel) {
                return; // The step got there first and computes it itself.
            }
            let mask = lock(&core.matcher)
                .compute_mask_or_eos()
                .map_err(|e| e.to_string());
            // An error means the constraint is gone (its generation ended, or it advanced
            // past this position): the mask is then unwanted.
            if tx.send(mask).is_err() {
                tracing::trace!("a mask computed ahead was not wanted");
            }
        });
        if ahead::submit(job).is_ok() {
            self.ahead = Some(Box::new(Ahead {
                claimed,
                rx: Mutex::new(rx),
            }));
        }
    }

    /// The mask at the current position: the one computed ahead if its job has started
    /// (waiting for the rest of it), else computed here — a job still queued, or on a thread
    /// the scheduler has not run, costs the step no more than no job at all.
    fn allowed(&mut self) -> Result<SimpleVob, GrammarError> {
        let started = self
            .ahead
            .take()
            .filter(|a| a.claimed.swap(true, Ordering::AcqRel));
        let mask = match started {
            Some(a) => {
                a.rx.into_inner()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .recv()
                    .unwrap_or_else(|_| Err("the mask job panicked".to_owned()))
            }
            None => lock(&self.core.matcher)
                .compute_mask_or_eos()
                .map_err(|e| e.to_string()),
        };
        mask.map_err(GrammarError::Step)
    }

    /// Sends every token the constraint does not allow next to −∞. Once the constraint is
    /// complete only the end-of-generation token is allowed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let _on_step = ahead::OnStepTimer::start();
        ahead::count_mask();
        let allowed = self.allowed()?;
        let words = allowed.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
                continue;
            }
            if bits == 0 {
                // Most words of a mask past the first characters: one fill, vectorised.
                chunk.fill(f32::NEG_INFINITY);
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// Advance past the sampled `token`, and start the next mask.
    pub fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        let _on_step = ahead::OnStepTimer::start();
        // A mask still ahead is for the position before `token` (its logits were not masked
        // through `mask`): unwanted. Claimed here, its job skips it; if it has started,
        // locking below waits for it to finish.
        if let Some(a) = self.ahead.take() {
            a.claimed.store(true, Ordering::Release);
        }
        {
            let mut m = lock(&self.core.matcher);
            m.consume_token(token)
                .map_err(|e| GrammarError::Step(e.to_string()))?;
            self.core.stopped.store(m.is_stopped(), Ordering::Release);
        }
        self.start_ahead();
        Ok(())
    }

    /// Whether the output is complete: nothing more may follow.
    pub fn is_complete(&self) -> bool {
        self.core.stopped.load(Ordering::Acquire)
    }
}

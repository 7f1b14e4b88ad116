//! Output constraints — any JSON object, a JSON schema, a Lark grammar or a regular expression —
//! enforced token by token with `llguidance` (the library mistral.rs uses and llama.cpp and vLLM
//! offer as a backend): before each sampled token the constraint's mask sends every token it
//! does not allow to −∞, and the sampled token advances it.
//!
//! Compiling a constraint can take milliseconds to seconds: [`Grammars::compile`] is called
//! where the request is parsed (the server's blocking pool, a decode node's handler), never on
//! the engine thread, which only computes masks. A constraint that cannot compile is the
//! caller's error, with the library's message.

use std::fmt;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use sha2::{Digest, Sha256};

use crate::tokenizer::Tokenizer;

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
        Ok(Constraint {
            spec: Arc::new(spec),
            matcher: Box::new(matcher),
        })
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
pub struct Constraint {
    spec: Arc<ConstraintSpec>,
    /// Boxed: ~1.6 KB, and requests move through bounded queues.
    matcher: Box<Matcher>,
}

impl Clone for Constraint {
    /// An independent copy at the same position (each of a request's choices advances its own).
    fn clone(&self) -> Self {
        Self {
            spec: self.spec.clone(),
            matcher: Box::new(self.matcher.deep_clone()),
        }
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("kind", &self.spec.kind)
            .field("sha256", &self.spec.sha256_hex())
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    pub fn spec(&self) -> &ConstraintSpec {
        &self.spec
    }

    /// Sends every token the constraint does not allow next to −∞. Once the constraint is
    /// complete only the end-of-generation token is allowed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Step(e.to_string()))?;
        let words = allowed.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
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

    /// Advance past the sampled `token`.
    pub fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Step(e.to_string()))
    }

    /// Whether the output is complete: nothing more may follow.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

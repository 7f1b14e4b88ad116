//! Tokenizer and chat template, both built from GGUF metadata.
//!
//! Two vocabulary kinds, as `tokenizer.ggml.model` names them:
//! - `gpt2`: byte-level BPE, through the `tokenizers` crate (Hugging Face's), configured from
//!   `tokenizer.ggml.{tokens,token_type,merges,pre}` with the pre-tokenizer named by
//!   `tokenizer.ggml.pre`. Control tokens (`token_type == 3`, e.g. `<|im_start|>`) are
//!   registered as special tokens so that they are matched whole in text.
//! - `llama`: SentencePiece with byte fallback, merged by piece score as llama.cpp does
//!   (`spm.rs`, which says why not through the crate).
//!
//! The chat template is the GGUF's own `tokenizer.chat_template`, rendered by `minijinja`.

mod spm;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::tokenizer::SplitDelimiterBehavior;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

use crate::gguf::{Gguf, GgufError, Value};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(
        "unsupported tokenizer model {0:?} (supported: gpt2 byte-level BPE, llama SentencePiece)"
    )]
    UnsupportedModel(String),
    #[error(
        "unsupported pre-tokenizer {0:?} (supported: smollm, starcoder, gpt2, default, \
         llama-bpe, llama3, qwen2, deepseek-r1-qwen)"
    )]
    UnsupportedPre(String),
    #[error("malformed merge {index}: {merge:?} (expected two space-separated symbols)")]
    BadMerge { index: usize, merge: String },
    #[error("tokenizer construction failed: {0}")]
    Build(String),
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("decoding failed: {0}")]
    Decode(String),
    #[error("the model has no chat template (tokenizer.chat_template)")]
    NoChatTemplate,
    #[error("{0}")]
    Tools(#[from] crate::tools::ToolError),
    #[error("chat template error: {0}")]
    Template(#[from] minijinja::Error),
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadTokenId { id: u32, vocab: usize },
}

/// One chat message, as the template sees it (OpenAI's field names).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    /// Text; an assistant turn that only called tools has `""` (OpenAI's `null`), which every
    /// template treats as empty (Qwen 3's would fail on `null`).
    pub content: String,
    /// An assistant turn's tool calls (absent from the template's view when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<crate::tools::ToolCallMessage>,
    /// A `tool` turn: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

/// Tokenizer plus the special ids and chat template of one model.
#[derive(Debug)]
pub struct Tokenizer {
    inner: Vocab,
    vocab_size: usize,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Whether the model expects BOS prepended to raw prompts.
    pub add_bos: bool,
    chat_template: Option<String>,
    /// Extra stop ids (e.g. `<|im_end|>`, `<|endoftext|>`).
    pub stop_ids: Vec<u32>,
    /// Per id: whether it is a control or user-defined token (matched whole, never produced by
    /// text) — what a grammar must not spell out of bytes.
    special: Vec<bool>,
}

/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3` split (Llama 3's tiktoken pattern): contractions,
/// letters with at most one leading non-letter, digits in runs of at most three, punctuation
/// runs, newlines, whitespace not followed by a non-space.
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2` split: Llama 3's, but every digit on its own.
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A regex split (each match its own piece) followed by the byte-level mapping without its own
/// GPT-2 regex — how Llama 3 and Qwen 2 vocabularies pre-tokenize.
fn split_then_bytes(pattern: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let split = Split::new(
        SplitPattern::Regex(pattern.to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| TokenizerError::Build(e.to_string()))?;
    Ok(Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
    ])
    .into())
}

// llama.cpp's `llama_token_type`, as `tokenizer.ggml.token_type` stores it.
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
const TOKEN_TYPE_BYTE: i64 = 6;

/// The vocabulary and its algorithm.
#[derive(Debug)]
enum Vocab {
    Bpe(Box<HfTokenizer>),
    Spm(spm::Spm),
}

impl Vocab {
    fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            Self::Bpe(t) => t.id_to_token(id),
            Self::Spm(s) => s.piece(id).map(str::to_owned),
        }
    }
}

/// Token types (`tokenizer.ggml.token_type`), normal where the file has none.
fn token_types(g: &Gguf, n: usize) -> Vec<i64> {
    match g.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().map_or(TOKEN_TYPE_NORMAL, |x| x as i64))
            .collect(),
        _ => vec![TOKEN_TYPE_NORMAL; n],
    }
}

/// A SentencePiece vocabulary from the file's tokens, scores and types.
fn spm_from_gguf(g: &Gguf, tokens: &[&str]) -> Result<spm::Spm, TokenizerError> {
    let scores: Vec<f32> = match g.get("tokenizer.ggml.scores") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::F32(x) => Ok(*x),
                other => Err(TokenizerError::Build(format!(
                    "tokenizer.ggml.scores holds {other:?}, not f32"
                ))),
            })
            .collect::<Result<_, _>>()?,
        _ => vec![0.0; tokens.len()],
    };
    // llama.cpp's default for SentencePiece vocabularies is to add the prefix.
    let add_space_prefix = !matches!(
        g.get("tokenizer.ggml.add_space_prefix"),
        Some(Value::Bool(false))
    );
    spm::Spm::new(
        tokens,
        scores,
        token_types(g, tokens.len()),
        add_space_prefix,
    )
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Self, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        let tokens = g.get_strings("tokenizer.ggml.tokens")?;
        let inner = match model {
            "gpt2" => Vocab::Bpe(Box::new(bpe_from_gguf(g, &tokens)?)),
            "llama" => Vocab::Spm(spm_from_gguf(g, &tokens)?),
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };
        Self::with_vocab(g, &tokens, inner)
    }

    fn with_vocab(g: &Gguf, tokens: &[&str], inner: Vocab) -> Result<Self, TokenizerError> {
        let id = |k: &str| g.get(k).and_then(Value::as_u64).map(|v| v as u32);
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let eos_id = id("tokenizer.ggml.eos_token_id");
        // Absent, llama.cpp adds BOS for SentencePiece vocabularies and not for BPE ones.
        let add_bos = match g.get("tokenizer.ggml.add_bos_token") {
            Some(Value::Bool(b)) => *b,
            _ => matches!(inner, Vocab::Spm(_)),
        };
        let chat_template = g.get_str("tokenizer.chat_template").ok().map(str::to_owned);
        let mut stop_ids: Vec<u32> = eos_id.into_iter().collect();
        for name in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>"] {
            if let Some(i) = tokens.iter().position(|t| *t == name)
                && !stop_ids.contains(&(i as u32))
            {
                stop_ids.push(i as u32);
            }
        }
        let special = token_types(g, tokens.len())
            .into_iter()
            .chain(std::iter::repeat(TOKEN_TYPE_NORMAL))
            .take(tokens.len())
            .map(|ty| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
            .collect();
        Ok(Self {
            inner,
            vocab_size: tokens.len(),
            bos_id,
            eos_id,
            add_bos,
            chat_template,
            stop_ids,
            special,
        })
    }
}

/// A byte-level BPE from the file's tokens, merges, token types and pre-tokenizer name.
fn bpe_from_gguf(g: &Gguf, tokens: &[&str]) -> Result<HfTokenizer, TokenizerError> {
    let merges_raw = g.get_strings("tokenizer.ggml.merges")?;
    let types = token_types(g, tokens.len());
    let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
    {
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| ((*t).to_owned(), i as u32))
            .collect();
        let mut merges = Vec::with_capacity(merges_raw.len());
        for (index, m) in merges_raw.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| TokenizerError::BadMerge {
                index,
                merge: (*m).to_owned(),
            })?;
            merges.push((a.to_owned(), b.to_owned()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let mut inner = HfTokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, true, true);
        let pre_tok: PreTokenizerWrapper = match pre {
            // llama.cpp's SMOLLM pre-tokenizer: split digits individually, then the GPT-2 regex.
            "smollm" | "starcoder" | "refact" | "codeshell" => Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level),
            ])
            .into(),
            "gpt2" | "default" => byte_level.into(),
            "llama-bpe" | "llama3" => split_then_bytes(LLAMA3_SPLIT)?,
            "qwen2" | "deepseek-r1-qwen" => split_then_bytes(QWEN2_SPLIT)?,
            other => return Err(TokenizerError::UnsupportedPre(other.to_owned())),
        };
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(types.iter().chain(std::iter::repeat(&1)))
            .filter(|(_, ty)| **ty == TOKEN_TYPE_CONTROL || **ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(t, _)| AddedToken::from((*t).to_owned(), true))
            .collect();
        inner.add_special_tokens(&specials);
        Ok(inner)
    }
}

impl Tokenizer {
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Encode text. Special-token text (e.g. `<|im_start|>`) maps to its single id. BOS is
    /// prepended only when `add_bos` is set in the model and `raw` is false.
    pub fn encode(&self, text: &str, raw: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos && !raw {
            ids.extend(self.bos_id);
        }
        match &self.inner {
            Vocab::Bpe(t) => {
                let enc = t
                    .encode(text, false)
                    .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Vocab::Spm(s) => ids.extend(s.encode(text)?),
        }
        Ok(ids)
    }

    /// Encode `text` as it continues earlier text (a constraint's forced bytes): no BOS and,
    /// for SentencePiece vocabularies with `add_space_prefix`, no space added before it —
    /// [`Self::encode`] starts a text, and its prefix would put a space the text lacks.
    pub fn encode_continuation(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.inner {
            Vocab::Bpe(_) => self.encode(text, true),
            Vocab::Spm(s) => s.encode_continuation(text),
        }
    }

    /// What token `id` stands for, as bytes: the bytes it adds to decoded output (a byte-level
    /// BPE token's characters mapped back to bytes; a SentencePiece piece with `▁` as a space,
    /// a byte token as its byte), and whether it is a special token (then `bytes` is its text,
    /// which only the token itself produces). `None` outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<TokenBytes> {
        let special = *self.special.get(id as usize)?;
        let bytes = match &self.inner {
            Vocab::Bpe(t) => {
                let text = t.id_to_token(id)?;
                if special {
                    text.into_bytes()
                } else {
                    byte_level_bytes(&text)
                }
            }
            Vocab::Spm(s) => s.decode_bytes(&[id]),
        };
        Some(TokenBytes { bytes, special })
    }

    /// Decode ids to text (special tokens are rendered).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= self.vocab_size) {
            return Err(TokenizerError::BadTokenId {
                id,
                vocab: self.vocab_size,
            });
        }
        match &self.inner {
            Vocab::Bpe(t) => t
                .decode(ids, false)
                .map_err(|e| TokenizerError::Decode(e.to_string())),
            // Byte tokens may split a character: an incomplete one ends in U+FFFD, as the
            // byte-level decoder's does (`StreamDecoder` waits on it).
            Vocab::Spm(s) => Ok(String::from_utf8_lossy(&s.decode_bytes(ids)).into_owned()),
        }
    }

    /// The token ids of a chat: the rendered template, tokenized with special texts as their
    /// ids and no BOS added — the template places its own (`{{ bos_token }}`), as Hugging
    /// Face's `apply_chat_template` and llama-cpp-python tokenize a chat (adding one too would
    /// start Llama 3 and Mistral prompts with two).
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
        self.encode(&self.apply_chat_template(messages)?, true)
    }

    /// Render the model's chat template over `messages`, with the assistant prompt appended.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        self.apply_chat_template_with(messages, None)
    }

    /// The token ids of a chat that offers `tools` (OpenAI's functions): see
    /// [`Self::apply_chat_template_tools`].
    pub fn encode_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[crate::tools::ToolDef],
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode(&self.apply_chat_template_tools(messages, tools)?, true)
    }

    /// Render a chat that offers `tools`: a template that renders `tools` itself gets them
    /// (as Hugging Face and llama-cpp-python pass them); one that does not gets them in a
    /// system message in its call format ([`crate::tools::ToolFormat::system_prompt`],
    /// appended to the first system message or placed before the chat), never dropped, and
    /// the history's calls and results in turns it knows
    /// ([`crate::tools::ToolFormat::polyfill_history`]).
    pub fn apply_chat_template_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[crate::tools::ToolDef],
    ) -> Result<String, TokenizerError> {
        let src = self
            .chat_template
            .as_deref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        if src.contains("tools") {
            if tools.is_empty() {
                return self.apply_chat_template(messages);
            }
            let defs: Vec<serde_json::Value> =
                tools.iter().map(crate::tools::ToolDef::to_openai).collect();
            return self.apply_chat_template_with(messages, Some(&defs));
        }
        let has_tool_turns = messages
            .iter()
            .any(|m| m.role == "tool" || !m.tool_calls.is_empty());
        if tools.is_empty() && !has_tool_turns {
            return self.apply_chat_template(messages);
        }
        let format = self
            .tool_format()
            .ok_or(crate::tools::ToolError::NoFormat)?;
        let mut msgs = format.polyfill_history(messages);
        if tools.is_empty() {
            return self.apply_chat_template(&msgs);
        }
        let prompt = format.system_prompt(tools);
        match msgs.first_mut() {
            Some(m) if m.role == "system" => m.content = format!("{}\n\n{prompt}", m.content),
            _ => msgs.insert(0, ChatMessage::new("system", prompt)),
        }
        self.apply_chat_template(&msgs)
    }

    /// How this model's template writes tool calls, if Custody knows the format.
    pub fn tool_format(&self) -> Option<crate::tools::ToolFormat> {
        self.chat_template
            .as_deref()
            .and_then(crate::tools::ToolFormat::detect)
    }

    /// The chat template in use: the GGUF's, or the one `set_chat_template` put in its place.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Use `template` instead of the GGUF's (`[model] chat_template_file`, as llama.cpp's
    /// `--chat-template-file` and vLLM's `--chat-template`): for files whose template predates
    /// tool calling.
    pub fn set_chat_template(&mut self, template: String) {
        self.chat_template = Some(template);
    }

    /// The id of the special token whose text is exactly `text` (e.g. Qwen's `<tool_call>`).
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        // Special texts encode to their single id.
        match self.encode(text, true).ok()?.as_slice() {
            &[id] if self.special.get(id as usize).copied()? => Some(id),
            _ => None,
        }
    }

    /// As [`Self::apply_chat_template`], with `tools` (OpenAI's `tools` array) given to the
    /// template as `tools`, as Hugging Face's `apply_chat_template` and llama-cpp-python pass it.
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, TokenizerError> {
        let src = self
            .chat_template
            .as_deref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        let mut env = minijinja::Environment::new();
        // As Hugging Face's `apply_chat_template` and llama-cpp-python's formatter build their
        // Jinja environments: block tags take their line's newline and leading indentation.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // The Python string and dict methods templates call (`.startswith`, `.strip`, `.items`).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        // Jinja2's `tojson`, as llama-cpp-python renders it (sorted keys, ASCII, HTML-safe):
        // tool definitions are rendered with it.
        env.add_filter("tojson", crate::tools::tojson_filter);
        env.add_template("chat", src)?;
        let bos = self
            .bos_id
            .and_then(|i| self.inner.id_to_token(i))
            .unwrap_or_default();
        let eos = self
            .eos_id
            .and_then(|i| self.inner.id_to_token(i))
            .unwrap_or_default();
        let out = env.get_template("chat")?.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => true,
            bos_token => bos,
            eos_token => eos,
        })?;
        Ok(out)
    }
}

/// One vocabulary entry as bytes (`Tokenizer::token_bytes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBytes {
    pub bytes: Vec<u8>,
    pub special: bool,
}

/// A byte-level BPE token's characters back to its bytes: GPT-2's byte-to-character map sends
/// the printable bytes `!`..`~`, `¡`..`¬` and `®`..`ÿ` to themselves and the other 68 bytes, in
/// order, to U+0100 onwards. A character outside the map (not in a byte-level vocabulary) keeps
/// its UTF-8 bytes.
fn byte_level_bytes(token: &str) -> Vec<u8> {
    const PRINTABLE: [std::ops::RangeInclusive<u32>; 3] = [0x21..=0x7e, 0xa1..=0xac, 0xae..=0xff];
    let mut shifted = [0u8; 68];
    let mut n = 0;
    for b in 0..=255u32 {
        if !PRINTABLE.iter().any(|r| r.contains(&b)) {
            shifted[n] = b as u8;
            n += 1;
        }
    }
    debug_assert_eq!(n, shifted.len());
    let mut out = Vec::with_capacity(token.len());
    for c in token.chars() {
        let u = c as u32;
        if PRINTABLE.iter().any(|r| r.contains(&u)) {
            out.push(u as u8);
        } else if let Some(&b) = u.checked_sub(0x100).and_then(|i| shifted.get(i as usize)) {
            out.push(b);
        } else {
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
    out
}

/// `raise_exception(msg)`, which templates call to refuse a conversation they cannot render
/// (roles out of order): the render fails with the template's own message.
fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        msg,
    ))
}

/// `strftime_now(format)`, which Llama 3.x templates call for today's date: the UTC date, with
/// `%d`, `%b`, `%B`, `%Y`, `%m` and `%%` (what chat templates use); other directives are kept
/// as written.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime_date(format.as_str(), secs / 86_400)
}

/// `format` for the day `days` after 1970-01-01 (Howard Hinnant's civil-from-days).
fn strftime_date(format: &str, days: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::with_capacity(format.len() + 8);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Incremental detokenizer for streaming: yields only complete UTF-8 text.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Decoding restarts here: a few tokens before the unread ones, so that byte-level merges
    /// across the boundary decode correctly without re-decoding the whole output (O(1) per token).
    prefix: usize,
    /// Tokens whose text has been returned.
    read: usize,
}

impl StreamDecoder {
    /// Add a token and return the newly completed text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        // An incomplete multi-byte sequence decodes to U+FFFD at the end: wait for more bytes.
        if now.ends_with('\u{FFFD}') || now.len() <= before.len() || !now.starts_with(&before) {
            return Ok(String::new());
        }
        let new = now[before.len()..].to_owned();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::strftime_date;

    /// The dates Llama 3.x templates ask `strftime_now` for, as Python's `strftime` writes them.
    #[test]
    fn strftime_date_writes_the_civil_date() {
        assert_eq!(strftime_date("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime_date("%d %b %Y", 19_930), "26 Jul 2024");
        assert_eq!(
            strftime_date("%Y-%m-%d %B %%", 11_016),
            "2000-02-29 February %"
        );
        assert_eq!(
            strftime_date("%H", 0),
            "%H",
            "other directives kept as written"
        );
    }
}

//! The OpenAI request bodies we accept, parsed strictly enough that bad input gets a clear
//! 400 naming the field, and leniently enough that the official clients' extra fields pass.

use serde::Deserialize;
use serde_json::Value;
#[cfg(test)]
use serde_json::json;

use custody_runtime::ChatMessage;
use custody_runtime::grammar::ConstraintSpec;

use crate::error::ApiError;

/// What a generation asks for, endpoint-independent.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Non-standard: also return the generated token ids (`custody validate` compares them).
    pub token_ids: bool,
    /// vLLM's `cache_salt`: narrows the prefix cache's namespace to requests that send the same
    /// salt *within the caller's tenant* (it is inside the tenant's MAC, so it never reaches
    /// another tenant's pages).
    pub cache_salt: Option<String>,
    /// `logit_bias`, as (token, bias).
    pub logit_bias: Vec<(u32, f32)>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// `Some(k)`: each token's log-probability and its `k` most likely alternatives.
    pub logprobs: Option<usize>,
    /// `response_format` (`json_object`, `json_schema`) or `structured_outputs`.
    pub constraint: Option<ConstraintSpec>,
    /// Which field the constraint came from (errors name it).
    pub constraint_param: &'static str,
    /// `tools`, `tool_choice`, `parallel_tool_calls` (chat only).
    pub tools: crate::tools::ToolRequest,
    /// `n`: choices (≥ 1; the server's `max_n` bounds it).
    pub n: usize,
}

/// Longest accepted `cache_salt`, bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 256;
/// Most alternatives `logprobs` returns per token on `/v1/completions` (OpenAI's limit).
pub const MAX_TEXT_LOGPROBS: u64 = 5;

/// The prompt as the client gave it.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

/// What Custody does with one request field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Honoured as OpenAI documents it.
    Honoured,
    /// Accepted and without effect on the output (nothing it asks for changes a token).
    NoEffect,
    /// Refused with a 400 naming it unless absent, `null`, or one of these values (JSON text).
    Refused(&'static [&'static str]),
}

/// One row of the field table: the field, what Custody does, and why (the README's table is
/// this one; `tests::readme_table_is_the_code_table` keeps them equal).
#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub support: Support,
    pub note: &'static str,
}

const fn f(name: &'static str, support: Support, note: &'static str) -> Field {
    Field {
        name,
        support,
        note,
    }
}

use Support::{Honoured, NoEffect, Refused};

/// Fields both endpoints share.
const COMMON_FIELDS: &[Field] = &[
    f(
        "model",
        Honoured,
        "must name the served model (404 otherwise)",
    ),
    f(
        "max_tokens",
        Honoured,
        "at least 1; default `serve.default_max_tokens`",
    ),
    f("temperature", Honoured, "[0, 2]; 0 is greedy"),
    f("top_p", Honoured, "(0, 1]"),
    f(
        "seed",
        Honoured,
        "reproducible on the same build and hardware",
    ),
    f(
        "stop",
        Honoured,
        "up to 4 strings, never sent, even split over chunks",
    ),
    f("stream", Honoured, "server-sent events, `[DONE]` last"),
    f(
        "stream_options",
        Honoured,
        "`include_usage`; `include_obfuscation` only false",
    ),
    f(
        "presence_penalty",
        Honoured,
        "[-2, 2], OpenAI's formula over this output",
    ),
    f(
        "frequency_penalty",
        Honoured,
        "[-2, 2], OpenAI's formula over this output",
    ),
    f(
        "logit_bias",
        Honoured,
        "up to 300 token ids, bias in [-100, 100]",
    ),
    f(
        "n",
        Honoured,
        "1 to `serve.max_n` (8); the prompt's pages computed once and shared through the prefix cache; choice i > 0 samples with its own seed stream",
    ),
    f("user", NoEffect, "recorded in the server's log only"),
    f(
        "cache_salt",
        Honoured,
        "extension (vLLM's): narrows the prefix cache within the tenant",
    ),
    f(
        "custody_token_ids",
        Honoured,
        "extension: also return the output token ids",
    ),
    f(
        "structured_outputs",
        Honoured,
        "extension (vLLM's): one of `json`, `regex`, `grammar` (Lark), `choice`",
    ),
];

/// Fields only `/v1/chat/completions` has.
const CHAT_FIELDS: &[Field] = &[
    f(
        "messages",
        Honoured,
        "`system`, `developer`, `user`, `assistant` (with `tool_calls`), `tool` (with `tool_call_id`): text `content` (any other message field: 400)",
    ),
    f(
        "max_completion_tokens",
        Honoured,
        "as `max_tokens` (wins over it)",
    ),
    f(
        "logprobs",
        Honoured,
        "after bias, penalties and the constraint's mask, before temperature",
    ),
    f("top_logprobs", Honoured, "0–20, needs `logprobs: true`"),
    f(
        "response_format",
        Honoured,
        "`text`, `json_object`, `json_schema` (`strict` true or false: both enforced)",
    ),
    f(
        "tools",
        Honoured,
        "functions (≤ 128), rendered by the chat template; every call grammar-constrained to its `parameters`",
    ),
    f(
        "tool_choice",
        Honoured,
        "`none` (nothing offered), `auto`, `required`, a named function",
    ),
    f(
        "parallel_tool_calls",
        Honoured,
        "false: at most one call per answer",
    ),
    f(
        "functions",
        Refused(&["[]"]),
        "deprecated by OpenAI; not served",
    ),
    f(
        "function_call",
        Refused(&["\"none\""]),
        "deprecated by OpenAI; not served",
    ),
    f("audio", Refused(&[]), "text models only"),
    f("modalities", Refused(&["[\"text\"]"]), "text only"),
    f(
        "prediction",
        Refused(&[]),
        "predicted outputs are not served",
    ),
    f("reasoning_effort", Refused(&[]), "not a reasoning model"),
    f("verbosity", Refused(&[]), "not a reasoning model"),
    f("web_search_options", Refused(&[]), "no web search"),
    f("store", Refused(&["false"]), "completions are not stored"),
    f("metadata", NoEffect, "only used with `store`"),
    f(
        "service_tier",
        Refused(&["\"auto\"", "\"default\""]),
        "one tier",
    ),
    f(
        "prompt_cache_key",
        NoEffect,
        "the prefix cache is keyed by tenant (and `cache_salt`)",
    ),
    f(
        "prompt_cache_retention",
        Refused(&["\"in_memory\""]),
        "the prefix cache lives in memory",
    ),
    f(
        "safety_identifier",
        NoEffect,
        "recorded in the server's log only",
    ),
];

/// Fields only `/v1/completions` has.
const TEXT_FIELDS: &[Field] = &[
    f(
        "prompt",
        Honoured,
        "a string, a list of one string, or token ids",
    ),
    f(
        "logprobs",
        Honoured,
        "0–5 alternatives per token, with `text_offset`",
    ),
    f("echo", Refused(&["false"]), "not yet"),
    f("best_of", Refused(&["1"]), "only 1"),
    f("suffix", Refused(&["\"\""]), "no fill-in-the-middle"),
];

/// The fields of one endpoint, in table order.
pub fn fields(chat: bool) -> impl Iterator<Item = &'static Field> {
    let own = if chat { CHAT_FIELDS } else { TEXT_FIELDS };
    own.iter().chain(COMMON_FIELDS)
}

/// The README's table of request fields (between its `api-fields` markers), made from the
/// tables above: a field, what each endpoint does with it, and why.
pub fn fields_markdown() -> String {
    let cell = |f: Option<&Field>| match f.map(|f| f.support) {
        None => "—".to_owned(),
        Some(Honoured) => "honoured".to_owned(),
        Some(NoEffect) => "no effect".to_owned(),
        Some(Refused(&[])) => "**400**".to_owned(),
        Some(Refused(ok)) => format!("**400** unless {}", ok.join(" or ")),
    };
    let mut names: Vec<&str> = Vec::new();
    for f in fields(true).chain(fields(false)) {
        if !names.contains(&f.name) {
            names.push(f.name);
        }
    }
    let mut out =
        String::from("| field | chat | completions | what Custody does |\n|---|---|---|---|\n");
    for n in names {
        let (c, t) = (
            fields(true).find(|f| f.name == n),
            fields(false).find(|f| f.name == n),
        );
        let note = match (c, t) {
            (Some(c), Some(t)) if c.note != t.note => {
                format!("chat: {}; completions: {}", c.note, t.note)
            }
            (Some(f), _) | (None, Some(f)) => f.note.to_owned(),
            (None, None) => String::new(),
        };
        out.push_str(&format!("| `{n}` | {} | {} | {note} |\n", cell(c), cell(t)));
    }
    out
}

/// Every top-level key must be a field of the endpoint; a refused field must be absent, null
/// or an allowed value.
fn check_fields(v: &Value, chat: bool) -> Result<(), ApiError> {
    let Value::Object(o) = v else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    for (k, val) in o {
        let Some(field) = fields(chat).find(|f| f.name == k) else {
            return Err(ApiError::bad_request(format!(
                "unknown field {k:?}: this endpoint takes {}",
                fields(chat).map(|f| f.name).collect::<Vec<_>>().join(", ")
            ))
            .param(k.clone()));
        };
        if let Refused(allowed) = field.support
            && !val.is_null()
            && !allowed
                .iter()
                .any(|a| serde_json::from_str::<Value>(a).ok().as_ref() == Some(val))
        {
            return Err(ApiError::bad_request(format!(
                "{k} is not supported ({}){}",
                field.note,
                if allowed.is_empty() {
                    String::new()
                } else {
                    format!("; accepted: {}", allowed.join(" or "))
                }
            ))
            .param(field.name));
        }
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    logprobs: Option<Value>,
    top_logprobs: Option<u64>,
    custody_token_ids: Option<bool>,
    cache_salt: Option<String>,
    n: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
    include_obfuscation: Option<bool>,
}

/// Largest `max_tokens` we look at: anything above any context is refused by admission anyway,
/// and this keeps the arithmetic far from overflow.
const MAX_TOKENS_CAP: u64 = 1 << 32;

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "could not parse the request body as JSON: {e} (the body must be a UTF-8 JSON object)"
        ))
    })?;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    Ok(v)
}

fn field_error(e: serde_json::Error) -> ApiError {
    ApiError::bad_request(format!("invalid request: {e}"))
}

fn common(v: &Value, chat: bool) -> Result<Params, ApiError> {
    check_fields(v, chat)?;
    let c: Common = serde_json::from_value(v.clone()).map_err(field_error)?;
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => None,
        Some(0) => {
            return Err(ApiError::bad_request("max_tokens must be at least 1").param("max_tokens"));
        }
        Some(n) => Some(n.min(MAX_TOKENS_CAP) as usize),
    };
    // OpenAI's defaults: temperature 1, top_p 1.
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(format!(
            "temperature must be in [0, 2], got {temperature}"
        ))
        .param("temperature"));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(
            ApiError::bad_request(format!("top_p must be in (0, 1], got {top_p}")).param("top_p"),
        );
    }
    let stop = parse_stop(c.stop)?;
    if c.cache_salt
        .as_ref()
        .is_some_and(|s| s.is_empty() || s.len() > MAX_CACHE_SALT_BYTES)
    {
        return Err(ApiError::bad_request(format!(
            "cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes"
        ))
        .param("cache_salt"));
    }
    let (include_usage, obfuscation) = c.stream_options.map_or((false, false), |o| {
        (
            o.include_usage.unwrap_or(false),
            o.include_obfuscation.unwrap_or(false),
        )
    });
    if obfuscation {
        return Err(ApiError::bad_request(
            "stream_options.include_obfuscation is not supported (only false)",
        )
        .param("stream_options"));
    }
    let mut logit_bias = Vec::new();
    for (k, b) in c.logit_bias.unwrap_or_default() {
        let token = k.parse::<u32>().map_err(|_| {
            ApiError::bad_request(format!("logit_bias keys must be token ids, got {k:?}"))
                .param("logit_bias")
        })?;
        logit_bias.push((token, b as f32));
    }
    let (constraint, constraint_param) = crate::structured::parse(v)?;
    let tools = if chat {
        crate::tools::parse(v)?
    } else {
        crate::tools::ToolRequest::default()
    };
    if tools.choice.is_some() && constraint.is_some() {
        return Err(ApiError::bad_request(format!(
            "{constraint_param} and tools cannot both constrain one answer (send tool_choice \"none\" or drop {constraint_param})"
        ))
        .param(constraint_param));
    }
    Ok(Params {
        model: c.model,
        cache_salt: c.cache_salt,
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        // A seed is an opaque number: negative ones are reinterpreted, not refused.
        seed: c.seed.map(|s| s as u64),
        stop,
        stream: c.stream.unwrap_or(false),
        include_usage,
        token_ids: c.custody_token_ids.unwrap_or(false),
        logit_bias,
        presence_penalty: c.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0) as f32,
        logprobs: parse_logprobs(c.logprobs, c.top_logprobs, chat)?,
        constraint,
        constraint_param,
        tools,
        n: match c.n {
            None => 1,
            Some(n @ 1..=MAX_TOKENS_CAP) => n as usize,
            Some(n) => {
                return Err(
                    ApiError::bad_request(format!("n must be at least 1, got {n}")).param("n"),
                );
            }
        },
    })
}

fn parse_stop(stop: Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::bad_request("stop must be a string or a list of strings").param("stop");
    let stop = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) => a
            .into_iter()
            .map(|x| match x {
                Value::String(s) => Ok(s),
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(
            ApiError::bad_request("stop: at most 4 sequences, none of them empty").param("stop"),
        );
    }
    Ok(stop)
}

/// Chat: `logprobs: true` and `top_logprobs` 0–20 (which needs it). Text: `logprobs` 0–5.
fn parse_logprobs(
    logprobs: Option<Value>,
    top: Option<u64>,
    chat: bool,
) -> Result<Option<usize>, ApiError> {
    let max = if chat {
        custody_runtime::decoding::MAX_TOP_LOGPROBS as u64
    } else {
        MAX_TEXT_LOGPROBS
    };
    if chat {
        let on = match logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(_) => {
                return Err(ApiError::bad_request("logprobs must be a boolean").param("logprobs"));
            }
        };
        return match (on, top) {
            (false, Some(_)) => {
                Err(ApiError::bad_request("top_logprobs needs logprobs: true")
                    .param("top_logprobs"))
            }
            (true, Some(k)) if k > max => Err(ApiError::bad_request(format!(
                "top_logprobs must be at most {max}, got {k}"
            ))
            .param("top_logprobs")),
            (true, k) => Ok(Some(k.unwrap_or(0) as usize)),
            (false, None) => Ok(None),
        };
    }
    match logprobs {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_u64().is_some_and(|k| k <= max) => {
            Ok(n.as_u64().map(|k| k as usize))
        }
        Some(other) => Err(ApiError::bad_request(format!(
            "logprobs must be an integer from 0 to {max}, got {other}"
        ))
        .param("logprobs")),
    }
}

/// `POST /v1/chat/completions`.
pub fn parse_chat(body: &[u8]) -> Result<(Prompt, Params), ApiError> {
    let v = parse_json(body)?;
    let params = common(&v, true)?;
    let Some(msgs) = v.get("messages") else {
        return Err(ApiError::bad_request("missing required field: messages").param("messages"));
    };
    let Value::Array(msgs) = msgs else {
        return Err(ApiError::bad_request("messages must be a list").param("messages"));
    };
    if msgs.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").param("messages"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let bad =
            |what: &str| ApiError::bad_request(format!("messages[{i}]: {what}")).param("messages");
        let Some(fields) = m.as_object() else {
            return Err(bad("must be an object with a role and content"));
        };
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing role"))?;
        let role = match role {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => return Err(bad(&format!("unsupported role {other:?}"))),
        };
        // A message field the template would not render is refused, not dropped.
        for (k, v) in fields {
            let empty = v.is_null() || v.as_array().is_some_and(Vec::is_empty);
            let own = match role {
                "assistant" => k == "tool_calls",
                "tool" => k == "tool_call_id",
                _ => false,
            };
            if !matches!(k.as_str(), "role" | "content") && !own && !empty {
                return Err(bad(&format!(
                    "field {k:?} is not supported on a {role} message (role and content; tool_calls on assistant, tool_call_id on tool messages)"
                )));
            }
        }
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        _ => return Err(bad("only text content parts are supported")),
                    }
                }
                s
            }
            // An assistant turn that only called tools: OpenAI's `null`.
            Some(Value::Null) | None if role == "assistant" => String::new(),
            _ => return Err(bad("content must be a string or a list of text parts")),
        };
        let msg = match role {
            "tool" => {
                crate::tools::tool_message(content, m.get("tool_call_id").and_then(Value::as_str))
                    .map_err(|e| bad(&e.to_string()))?
            }
            "assistant" => ChatMessage {
                tool_calls: match m.get("tool_calls") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(c) => {
                        crate::tools::parse_message_calls(c).map_err(|e| bad(&e.to_string()))?
                    }
                },
                ..ChatMessage::new(role, content)
            },
            _ => ChatMessage::new(role, content),
        };
        out.push(msg);
    }
    Ok((Prompt::Chat(out), params))
}

/// `POST /v1/completions`.
pub fn parse_completion(body: &[u8]) -> Result<(Prompt, Params), ApiError> {
    let v = parse_json(body)?;
    let params = common(&v, false)?;
    let bad = || {
        ApiError::bad_request(
            "prompt must be a string, a list of one string, or a list of token ids",
        )
        .param("prompt")
    };
    let prompt = match v.get("prompt") {
        None => {
            return Err(ApiError::bad_request("missing required field: prompt").param("prompt"));
        }
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Prompt::Text(a[0].as_str().unwrap_or_default().to_owned())
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => Prompt::Tokens(
            a.iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(bad)
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(Value::is_string) => {
            return Err(ApiError::bad_request(
                "batched prompts are not supported: send one prompt per request",
            )
            .param("prompt"));
        }
        Some(_) => return Err(bad()),
    };
    Ok((prompt, params))
}

/// Applies stop sequences to streamed text: text that could still be the start of a stop
/// sequence is held back until it is known not to be one, so a stop sequence never reaches the
/// client, not even split over two chunks.
#[derive(Debug, Default)]
pub struct StopText {
    stops: Vec<String>,
    text: String,
    emitted: usize,
}

impl StopText {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Add decoded text: (text that may be sent now, whether a stop sequence was reached; then
    /// generation ends and the stop sequence and anything after it are dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.text.push_str(piece);
        // A stop sequence always starts at or after `emitted`: anything before was known not
        // to begin one (see `hold_from`).
        let tail = &self.text[self.emitted..];
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| tail.find(s.as_str()))
            .min()
        {
            let out = tail[..at].to_owned();
            self.emitted += at;
            self.text.truncate(self.emitted);
            return (out, true);
        }
        let hold = self.hold_from();
        let out = self.text[self.emitted..hold].to_owned();
        self.emitted = hold;
        (out, false)
    }

    /// Where the longest suffix that is a proper prefix of some stop sequence starts.
    fn hold_from(&self) -> usize {
        for (i, _) in self.text[self.emitted..].char_indices() {
            let at = self.emitted + i;
            let rest = &self.text[at..];
            if self.stops.iter().any(|s| s.starts_with(rest)) {
                return at;
            }
        }
        self.text.len()
    }

    /// Generation ended without a stop: whatever was held back.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_owned();
        self.emitted = self.text.len();
        out
    }

    /// Everything emitted so far.
    pub fn text(&self) -> &str {
        &self.text[..self.emitted]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_table_is_the_code_table() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
            .expect("README.md");
        let (begin, end) = ("<!-- BEGIN api-fields -->\n", "<!-- END api-fields -->");
        let at = readme.find(begin).expect("README has the api-fields table") + begin.len();
        let table = &readme[at..at + readme[at..].find(end).expect("end marker")];
        let want = fields_markdown();
        assert_eq!(
            table, want,
            "README's request-field table is stale; it should read:\n{want}"
        );
    }

    #[test]
    fn every_field_outside_the_table_and_every_refused_value_is_a_400_naming_it() {
        for chat in [true, false] {
            let base = if chat {
                json!({"messages": [{"role": "user", "content": "hi"}]})
            } else {
                json!({"prompt": "hi"})
            };
            for f in fields(chat) {
                let mut body = base.clone();
                body[f.name] = json!({"custody": "a value no field takes"});
                let r = if chat {
                    parse_chat(body.to_string().as_bytes())
                } else {
                    parse_completion(body.to_string().as_bytes())
                };
                match f.support {
                    Refused(_) => {
                        let e = r.expect_err(f.name);
                        assert_eq!(e.param.as_deref(), Some(f.name), "{}", e.message);
                    }
                    // Honoured and no-effect fields parse their value: this one is malformed for
                    // most, but never refused as unsupported.
                    Honoured | NoEffect => {
                        if let Err(e) = r {
                            assert!(
                                !e.message.contains("not supported")
                                    || f.name == "response_format"
                                    || f.name == "structured_outputs",
                                "{}: {}",
                                f.name,
                                e.message
                            );
                        }
                    }
                }
            }
            let mut body = base.clone();
            body["frobnicate"] = json!(1);
            let e = if chat {
                parse_chat(body.to_string().as_bytes())
            } else {
                parse_completion(body.to_string().as_bytes())
            }
            .expect_err("unknown");
            assert_eq!(e.param.as_deref(), Some("frobnicate"));
        }
        // Allowed values of refused fields pass.
        let ok = br#"{"messages": [{"role": "user", "content": "hi"}], "n": 1, "store": false, "modalities": ["text"], "service_tier": "auto", "tools": [], "tool_choice": "none"}"#;
        assert!(parse_chat(ok).is_ok());
    }

    #[test]
    fn stop_sequence_split_across_pieces_is_never_sent() {
        let mut s = StopText::new(vec!["END".into(), "\n\n".into()]);
        let mut sent = String::new();
        let mut stopped = false;
        for p in ["Hello E", "N", "x and E", "ND more"] {
            let (out, stop) = s.push(p);
            sent.push_str(&out);
            if stop {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        assert_eq!(sent, "Hello ENx and ");
        assert_eq!(s.text(), "Hello ENx and ");
    }

    #[test]
    fn held_text_is_released_at_finish() {
        let mut s = StopText::new(vec!["abc".into()]);
        assert_eq!(s.push("xab"), ("x".into(), false));
        assert_eq!(s.finish(), "ab");
        let mut none = StopText::new(Vec::new());
        assert_eq!(none.push("héllo"), ("héllo".into(), false));
    }

    #[test]
    fn bad_bodies_are_400_with_a_reason() {
        for (body, needle) in [
            (&b"{"[..], "could not parse"),
            (b"[]", "JSON object"),
            (b"\xff\xfe", "could not parse"),
            (b"{\"messages\": 3}", "messages must be a list"),
            (b"{\"messages\": []}", "must not be empty"),
            (
                b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 1e999}",
                "could not parse",
            ),
            (
                b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": -1}",
                "invalid request",
            ),
            (
                b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": 9}",
                "temperature",
            ),
            (
                b"{\"messages\": [{\"role\": \"robot\", \"content\": \"hi\"}]}",
                "unsupported role",
            ),
            (
                b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\", \"name\": \"bob\"}]}",
                "field \"name\" is not supported",
            ),
            (
                b"{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"id\": \"1\"}]}]}",
                "tool_calls[0] has no function",
            ),
            (
                b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\", \"tool_call_id\": \"1\"}]}",
                "field \"tool_call_id\" is not supported on a user message",
            ),
            (
                b"{\"messages\": [{\"role\": \"tool\", \"content\": \"4\"}]}",
                "a tool message needs tool_call_id",
            ),
            (b"{\"messages\": [3]}", "must be an object"),
        ] {
            let e = parse_chat(body).expect_err(needle);
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(e.message.contains(needle), "{needle}: {}", e.message);
        }
        let (p, params) = parse_completion(
            br#"{"prompt": [1, 2, 3], "max_tokens": 5, "stop": "x", "seed": -1, "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .expect("valid");
        assert_eq!(p, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(params.max_tokens, Some(5));
        assert_eq!(params.stop, vec!["x".to_owned()]);
        assert_eq!(params.seed, Some(u64::MAX));
        assert!(params.stream && params.include_usage);
        assert!(parse_completion(br#"{"prompt": [99999999999]}"#).is_err());
        assert!(parse_completion(br#"{"prompt": ["a", "b"]}"#).is_err());
    }
}

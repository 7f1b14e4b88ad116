//! The OpenAI request bodies we accept, parsed strictly enough that bad input gets a clear
//! 400 naming the field, and leniently enough that the official clients' extra fields pass.

use serde::Deserialize;
use serde_json::Value;

use custody_runtime::ChatMessage;

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
}

/// Longest accepted `cache_salt`, bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 256;

/// The prompt as the client gave it.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
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
    n: Option<u64>,
    best_of: Option<u64>,
    logprobs: Option<Value>,
    echo: Option<bool>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    tools: Option<Value>,
    custody_token_ids: Option<bool>,
    cache_salt: Option<String>,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
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

fn common(v: &Value) -> Result<Params, ApiError> {
    let c: Common = serde_json::from_value(v.clone()).map_err(field_error)?;
    if c.n.is_some_and(|n| n != 1) || c.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only n = 1 (and best_of = 1) is supported").param("n"));
    }
    if c.logprobs
        .as_ref()
        .is_some_and(|l| !l.is_null() && *l != Value::Bool(false))
    {
        return Err(ApiError::bad_request("logprobs are not supported").param("logprobs"));
    }
    if c.echo == Some(true) {
        return Err(ApiError::bad_request("echo is not supported").param("echo"));
    }
    for (name, p) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if p.is_some_and(|p| p != 0.0) {
            return Err(ApiError::bad_request(format!(
                "{name} is not supported (only 0)"
            )));
        }
    }
    if c.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::bad_request("tools are not supported").param("tools"));
    }
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
    let stop = match c.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) => a
            .into_iter()
            .map(|x| match x {
                Value::String(s) => Ok(s),
                _ => Err(
                    ApiError::bad_request("stop must be a string or a list of strings")
                        .param("stop"),
                ),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(
                ApiError::bad_request("stop must be a string or a list of strings").param("stop"),
            );
        }
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(
            ApiError::bad_request("stop: at most 4 sequences, none of them empty").param("stop"),
        );
    }
    if c.cache_salt
        .as_ref()
        .is_some_and(|s| s.is_empty() || s.len() > MAX_CACHE_SALT_BYTES)
    {
        return Err(ApiError::bad_request(format!(
            "cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes"
        ))
        .param("cache_salt"));
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
        include_usage: c
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        token_ids: c.custody_token_ids.unwrap_or(false),
    })
}

/// `POST /v1/chat/completions`.
pub fn parse_chat(body: &[u8]) -> Result<(Prompt, Params), ApiError> {
    let v = parse_json(body)?;
    let params = common(&v)?;
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
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("missing role"))?;
        let role = match role {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => return Err(bad(&format!("unsupported role {other:?}"))),
        };
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
            Some(Value::Null) | None if role == "assistant" => String::new(),
            _ => return Err(bad("content must be a string or a list of text parts")),
        };
        out.push(ChatMessage {
            role: role.into(),
            content,
        });
    }
    Ok((Prompt::Chat(out), params))
}

/// `POST /v1/completions`.
pub fn parse_completion(body: &[u8]) -> Result<(Prompt, Params), ApiError> {
    let v = parse_json(body)?;
    let params = common(&v)?;
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

//! `tools`, `tool_choice` and `parallel_tool_calls` of a chat request, and the assistant and
//! `tool` messages of earlier turns: parsed strictly (a 400 naming the field), turned into the
//! engine's [`ToolDef`]s. The format, grammar and parser live in `custody_runtime::tools`.

use serde_json::{Value, json};

use custody_runtime::ChatMessage;
use custody_runtime::tools::{
    MAX_TOOL_NAME_BYTES, MAX_TOOLS, ParsedCall, ToolCallFunction, ToolCallMessage, ToolChoice,
    ToolDef,
};

use crate::error::ApiError;

/// What a chat request asks about tools.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolRequest {
    /// The functions offered (empty with `tool_choice: "none"`: nothing is offered).
    pub tools: Vec<ToolDef>,
    /// `None` when no tools are offered.
    pub choice: Option<ToolChoice>,
    /// `parallel_tool_calls` (default true): more than one call per answer.
    pub parallel: bool,
}

/// A malformed tool definition or tool message (the caller names the field).
#[derive(Debug, thiserror::Error)]
pub enum ToolInputError {
    #[error("must be an object")]
    NotObject,
    #[error("field {0:?} is not supported (type, function)")]
    ToolField(String),
    #[error("type must be \"function\" (the only kind served)")]
    NotFunction,
    #[error("function must be an object")]
    FunctionNotObject,
    #[error("function field {0:?} is not supported (name, description, parameters, strict)")]
    FunctionField(String),
    #[error("function.name must be 1–{MAX_TOOL_NAME_BYTES} of a-z, A-Z, 0-9, _ and -")]
    Name,
    #[error("function.{field} must be {what}")]
    FieldType {
        field: &'static str,
        what: &'static str,
    },
    #[error("tool_calls must be a list")]
    CallsNotList,
    #[error("tool_calls[{0}] has no function")]
    CallNoFunction(usize),
    #[error("tool_calls[{0}].function.name must be a string")]
    CallName(usize),
    #[error("tool_calls[{index}].function.arguments is not JSON: {reason}")]
    CallArguments { index: usize, reason: String },
    #[error("tool_calls[{0}].function.arguments must be a JSON string")]
    CallArgumentsType(usize),
    #[error("a tool message needs tool_call_id")]
    NoCallId,
}

fn bad(param: &'static str, what: String) -> ApiError {
    ApiError::bad_request(what).param(param)
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= MAX_TOOL_NAME_BYTES
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tools`, `tool_choice`, `parallel_tool_calls` of body `v`.
pub fn parse(v: &Value) -> Result<ToolRequest, ApiError> {
    let mut tools = Vec::new();
    match v.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.len() <= MAX_TOOLS => {
            for (i, t) in a.iter().enumerate() {
                let def = parse_tool(t).map_err(|e| bad("tools", format!("tools[{i}]: {e}")))?;
                if tools.iter().any(|d: &ToolDef| d.name == def.name) {
                    return Err(bad(
                        "tools",
                        format!("tools[{i}]: function {:?} is offered twice", def.name),
                    ));
                }
                tools.push(def);
            }
        }
        Some(Value::Array(_)) => {
            return Err(bad("tools", format!("at most {MAX_TOOLS} tools")));
        }
        Some(_) => return Err(bad("tools", "tools must be a list".into())),
    }
    let choice = match v.get("tool_choice") {
        None | Some(Value::Null) => (!tools.is_empty()).then_some(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => None,
            "auto" => (!tools.is_empty()).then_some(ToolChoice::Auto),
            "required" => Some(ToolChoice::Required),
            other => {
                return Err(bad(
                    "tool_choice",
                    format!(
                        "tool_choice must be \"none\", \"auto\", \"required\" or a function, got {other:?}"
                    ),
                ));
            }
        },
        Some(o @ Value::Object(_)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad(
                        "tool_choice",
                        "tool_choice as an object must be {\"type\": \"function\", \"function\": {\"name\": …}}".into(),
                    )
                })?;
            Some(ToolChoice::Function(name.to_owned()))
        }
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "tool_choice must be a string or an object".into(),
            ));
        }
    };
    match &choice {
        Some(ToolChoice::Required) if tools.is_empty() => {
            return Err(bad(
                "tool_choice",
                "tool_choice \"required\" needs tools".into(),
            ));
        }
        Some(ToolChoice::Function(n)) if !tools.iter().any(|t| &t.name == n) => {
            return Err(bad(
                "tool_choice",
                format!("tool_choice names {n:?}, which is not among the tools"),
            ));
        }
        _ => {}
    }
    let parallel = match v.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad(
                "parallel_tool_calls",
                "parallel_tool_calls must be a boolean".into(),
            ));
        }
    };
    if choice.is_none() {
        tools.clear();
    }
    Ok(ToolRequest {
        tools,
        choice,
        parallel,
    })
}

fn parse_tool(t: &Value) -> Result<ToolDef, ToolInputError> {
    let o = t.as_object().ok_or(ToolInputError::NotObject)?;
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "type" | "function"))
    {
        return Err(ToolInputError::ToolField(k.clone()));
    }
    if o.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ToolInputError::NotFunction);
    }
    let f = o
        .get("function")
        .and_then(Value::as_object)
        .ok_or(ToolInputError::FunctionNotObject)?;
    if let Some(k) = f
        .keys()
        .find(|k| !matches!(k.as_str(), "name" | "description" | "parameters" | "strict"))
    {
        return Err(ToolInputError::FunctionField(k.clone()));
    }
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| valid_name(n))
        .ok_or(ToolInputError::Name)?;
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ToolInputError::FieldType {
                field: "description",
                what: "a string",
            });
        }
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ToolInputError::FieldType {
                field: "parameters",
                what: "a JSON Schema object",
            });
        }
    };
    let strict = match f.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ToolInputError::FieldType {
                field: "strict",
                what: "a boolean",
            });
        }
    };
    Ok(ToolDef {
        name: name.to_owned(),
        description,
        parameters,
        strict,
    })
}

/// An assistant message's `tool_calls`, with each call's `arguments` (a JSON string, as OpenAI
/// sends it) parsed into the object templates render.
pub fn parse_message_calls(v: &Value) -> Result<Vec<ToolCallMessage>, ToolInputError> {
    let a = v.as_array().ok_or(ToolInputError::CallsNotList)?;
    let mut out = Vec::with_capacity(a.len());
    for (i, c) in a.iter().enumerate() {
        let f = c.get("function").ok_or(ToolInputError::CallNoFunction(i))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or(ToolInputError::CallName(i))?;
        let arguments = match f.get("arguments") {
            Some(Value::String(s)) => {
                serde_json::from_str::<Value>(s).map_err(|e| ToolInputError::CallArguments {
                    index: i,
                    reason: e.to_string(),
                })?
            }
            Some(o @ Value::Object(_)) => o.clone(),
            _ => {
                return Err(ToolInputError::CallArgumentsType(i));
            }
        };
        out.push(ToolCallMessage {
            id: c
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            kind: "function".into(),
            function: ToolCallFunction {
                name: name.to_owned(),
                arguments,
            },
        });
    }
    Ok(out)
}

/// A `tool` message: its result and the call it answers.
pub fn tool_message(content: String, call_id: Option<&str>) -> Result<ChatMessage, ToolInputError> {
    let id = call_id.ok_or(ToolInputError::NoCallId)?;
    Ok(ChatMessage {
        role: "tool".into(),
        content,
        tool_call_id: Some(id.to_owned()),
        ..ChatMessage::default()
    })
}

/// The `tool_calls` of a response message (or, with `index`, of a stream chunk's delta).
pub fn calls_json(calls: &[ParsedCall], request_id: &str, streamed: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": format!("call_{request_id}_{i}"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if streamed {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

/// A streamed answer to a request with tools: text goes out as soon as it cannot be the start
/// of a call; output that starts with the format's trigger is a call, held until the end
/// (the grammar decides at the first characters which of the two it is).
#[derive(Debug)]
pub enum Held {
    Undecided(String),
    Text,
    Calls(String),
}

impl Held {
    pub fn new() -> Self {
        Self::Undecided(String::new())
    }

    /// Take `piece`; returns the text to send now (possibly empty).
    pub fn push(&mut self, piece: &str, trigger: &str) -> String {
        match self {
            Self::Text => piece.to_owned(),
            Self::Calls(buf) => {
                buf.push_str(piece);
                String::new()
            }
            Self::Undecided(buf) => {
                buf.push_str(piece);
                let t = buf.trim_start();
                if t.starts_with(trigger) {
                    *self = Self::Calls(std::mem::take(buf));
                    String::new()
                } else if trigger.starts_with(t) {
                    String::new()
                } else {
                    let out = std::mem::take(buf);
                    *self = Self::Text;
                    out
                }
            }
        }
    }
}

impl Default for Held {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})
    }

    #[test]
    fn refusals_name_their_field() {
        for (body, param) in [
            (json!({"tools": 3}), "tools"),
            (json!({"tools": [{"type": "retrieval"}]}), "tools"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools",
            ),
            (json!({"tools": [weather(), weather()]}), "tools"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
                "tools",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "absent"}}}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "parallel_tool_calls": "yes"}),
                "parallel_tool_calls",
            ),
        ] {
            let e = parse(&body).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn streamed_text_is_held_only_while_it_could_start_a_call() {
        let mut h = Held::new();
        assert_eq!(h.push("<tool", "<tool_call>"), "");
        assert_eq!(h.push("box>", "<tool_call>"), "<toolbox>");
        assert_eq!(h.push(" more", "<tool_call>"), " more");
        let mut h = Held::new();
        assert_eq!(h.push("<tool_call>\n{", "<tool_call>"), "");
        assert_eq!(h.push("}", "<tool_call>"), "");
        assert!(matches!(h, Held::Calls(ref b) if b == "<tool_call>\n{}"));
    }

    #[test]
    fn none_offers_nothing_and_auto_is_the_default() {
        let r = parse(&json!({"tools": [weather()], "tool_choice": "none"})).expect("ok");
        assert!(r.tools.is_empty() && r.choice.is_none());
        let r = parse(&json!({"tools": [weather()]})).expect("ok");
        assert_eq!(r.choice, Some(ToolChoice::Auto));
        assert!(r.parallel);
    }
}

//! Tool calling: the functions a chat offers, how the model's chat template writes a call (its
//! [`ToolFormat`]), the grammar that makes every call parse, and the parser that reads calls
//! back out of the generated text.
//!
//! Three formats, found in the template's own text (as llama.cpp's `common/chat` does):
//! - [`ToolFormat::Hermes`]: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one
//!   block per call — Qwen 2.5 and 3, and ChatML templates without tools of their own
//!   (SmolLM2);
//! - [`ToolFormat::Llama3Json`]: the answer is `{"name": …, "parameters": {…}}` — Llama 3.1–3.3;
//! - [`ToolFormat::Mistral`]: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` — Mistral.
//!
//! A template that renders `tools` itself gets them (Hugging Face's and llama-cpp-python's
//! `tools` variable); one that does not gets them in a system message written in its format
//! ([`ToolFormat::system_prompt`]), so tools are never silently dropped.
//!
//! Every request with tools is constrained ([`tool_grammar`]): with `tool_choice: "auto"` the
//! output is either text that never starts a call or calls whose arguments match the
//! function's `parameters`; `required` and a named function allow calls only. So a call always
//! parses — as llama.cpp's lazy tool grammars and vLLM's guided tool choice make sure.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::grammar::{ConstraintKind, ConstraintSpec};
use crate::tokenizer::ChatMessage;

/// Most functions one request may offer.
pub const MAX_TOOLS: usize = 128;
/// Longest function name (OpenAI's limit), bytes.
pub const MAX_TOOL_NAME_BYTES: usize = 64;

/// One function a request offers (`tools[i].function`).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema object for the arguments (`{"type": "object"}` when absent).
    pub parameters: Value,
    /// OpenAI's `strict`: every call is constrained here anyway, so it only changes nothing.
    pub strict: bool,
}

impl ToolDef {
    /// The OpenAI `tools` entry the template receives.
    pub fn to_openai(&self) -> Value {
        let mut f = Map::new();
        f.insert("name".into(), json!(self.name));
        if let Some(d) = &self.description {
            f.insert("description".into(), json!(d));
        }
        f.insert("parameters".into(), self.parameters.clone());
        json!({"type": "function", "function": f})
    }
}

/// `tool_choice`, past `"none"` (which offers no tools at all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Text or calls, as the model decides.
    Auto,
    /// At least one call.
    Required,
    /// Calls of this function only.
    Function(String),
}

impl ToolChoice {
    /// As the audit log records it.
    pub fn label(&self) -> String {
        match self {
            Self::Auto => "auto".into(),
            Self::Required => "required".into(),
            Self::Function(n) => format!("function:{n}"),
        }
    }
}

/// A call in an earlier assistant turn (OpenAI's `tool_calls[i]`), as templates read it:
/// `arguments` is an object (the client's JSON string parsed, as vLLM and llama.cpp do), so
/// that `tool_call.arguments | tojson` writes JSON once, not a quoted string.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCallMessage {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ToolCallFunction,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCallFunction {
    pub name: String,
    pub arguments: Value,
}

/// A call read from the model's output: `arguments` as compact JSON text (OpenAI's shape).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// The model's output split into text and calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedOutput {
    /// Text outside the calls, trimmed; `None` when there is none.
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

/// Why a request's tools were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ToolError {
    #[error(
        "this model's chat template has no tool-call format Custody knows (ChatML/Hermes, Llama 3, Mistral); set [model] chat_template_file to one that has"
    )]
    NoFormat,
    #[error("tool_choice names {0:?}, which is not among the tools")]
    UnknownChoice(String),
}

/// How a chat template writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
}

impl ToolFormat {
    /// The format of `template`, from the markers only its family writes.
    pub fn detect(template: &str) -> Option<Self> {
        if template.contains("[TOOL_CALLS]") || template.contains("[INST]") {
            Some(Self::Mistral)
        } else if template.contains("<tool_call>") || template.contains("<|im_start|>") {
            Some(Self::Hermes)
        } else if template.contains("<|start_header_id|>") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
        }
    }

    /// The text that starts a call: output that begins with it is a call (held back while
    /// streaming until it is whole), anything else is text.
    pub fn trigger(self) -> &'static str {
        match self {
            Self::Hermes => "<tool_call>",
            Self::Llama3Json => "{",
            Self::Mistral => "[TOOL_CALLS]",
        }
    }

    /// The key a call's arguments go under.
    fn arguments_key(self) -> &'static str {
        match self {
            Self::Llama3Json => "parameters",
            Self::Hermes | Self::Mistral => "arguments",
        }
    }

    /// Tools described in a system message, for a template that does not render `tools`:
    /// the functions as JSON and how to call them, in the format the parser reads.
    pub fn system_prompt(self, tools: &[ToolDef]) -> String {
        let mut s = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        for t in tools {
            s.push('\n');
            s.push_str(&python_json(&t.to_openai(), None));
        }
        s.push_str("\n</tools>\n\n");
        s.push_str(match self {
            Self::Hermes => {
                "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
            }
            Self::Llama3Json => {
                "To call a function, respond only with a JSON object in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
            }
            Self::Mistral => {
                "To call functions, respond only with [TOOL_CALLS] followed by a JSON list of objects in the format {\"name\": function name, \"arguments\": dictionary of argument name and its value}."
            }
        });
        s
    }

    /// A call turn as this format writes it — what [`tool_grammar`] makes the model write,
    /// with its separators — after the turn's own text, if any.
    pub fn call_turn_text(self, content: &str, calls: &[ToolCallMessage]) -> String {
        let key = self.arguments_key();
        let one = |c: &ToolCallMessage| {
            python_json(
                &json!({"name": c.function.name, key: c.function.arguments}),
                None,
            )
        };
        let written = match self {
            Self::Hermes => calls
                .iter()
                .map(|c| format!("<tool_call>\n{}\n</tool_call>", one(c)))
                .collect::<Vec<_>>()
                .join("\n"),
            Self::Llama3Json => calls.iter().map(one).collect::<Vec<_>>().join("\n"),
            Self::Mistral => {
                let list: Vec<String> = calls.iter().map(one).collect();
                format!("[TOOL_CALLS] [{}]", list.join(", "))
            }
        };
        if content.is_empty() {
            written
        } else {
            format!("{content}\n{written}")
        }
    }

    /// A tool's result as a user turn's text: Hermes' `<tool_response>` block; otherwise a
    /// `{"tool_response": ...}` object, as llama.cpp's template polyfills write it.
    pub fn result_text(self, name: Option<&str>, content: &str) -> String {
        match self {
            Self::Hermes => format!("<tool_response>\n{content}\n</tool_response>"),
            Self::Llama3Json | Self::Mistral => python_json(
                &json!({"tool_response": {"tool": name.unwrap_or_default(), "content": content}}),
                None,
            ),
        }
    }

    /// A history with calls and results, for a template that renders neither (it does not
    /// render `tools`, so it knows no `tool_calls` and no `tool` role): each call turn becomes
    /// an assistant turn with the calls written as this format writes them
    /// ([`Self::call_turn_text`]), and each run of tool results one user turn
    /// ([`Self::result_text`]) — so a template that wants user and assistant to alternate
    /// still renders it, and the model sees its calls and their results, not nothing.
    pub fn polyfill_history(self, messages: &[ChatMessage]) -> Vec<ChatMessage> {
        let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
        let mut results_open = false;
        for m in messages {
            if m.role == "tool" {
                let name = m.tool_call_id.as_deref().and_then(|id| {
                    messages
                        .iter()
                        .flat_map(|m| &m.tool_calls)
                        .find(|c| c.id == id)
                        .map(|c| c.function.name.as_str())
                });
                let text = self.result_text(name, &m.content);
                match out.last_mut() {
                    Some(prev) if results_open => {
                        prev.content.push('\n');
                        prev.content.push_str(&text);
                    }
                    _ => out.push(ChatMessage::new("user", text)),
                }
                results_open = true;
                continue;
            }
            results_open = false;
            if m.tool_calls.is_empty() {
                out.push(m.clone());
            } else {
                let text = self.call_turn_text(&m.content, &m.tool_calls);
                out.push(ChatMessage::new(m.role.clone(), text));
            }
        }
        out
    }

    /// Split `text` (the whole output) into content and calls. Output that does not parse as
    /// calls of the offered functions is content, whole (as llama.cpp's parsers do); with the
    /// grammar in force that only happens to output cut by `max_tokens`.
    pub fn parse(self, text: &str, offered: &[ToolDef]) -> ParsedOutput {
        let calls = match self {
            Self::Hermes => parse_hermes(text),
            Self::Llama3Json => parse_llama3(text),
            Self::Mistral => parse_mistral(text),
        };
        match calls {
            Some((content, calls))
                if !calls.is_empty()
                    && calls
                        .iter()
                        .all(|c| offered.iter().any(|t| t.name == c.name)) =>
            {
                ParsedOutput {
                    content: Some(content.trim().to_owned()).filter(|c| !c.is_empty()),
                    calls,
                }
            }
            _ => ParsedOutput {
                content: Some(text.to_owned()).filter(|c| !c.is_empty()),
                calls: Vec::new(),
            },
        }
    }
}

/// One call object (`{"name": …, "arguments"|"parameters": …}`).
fn call_of(v: &Value) -> Option<ParsedCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_owned();
    let args = o.get("arguments").or_else(|| o.get("parameters"))?;
    let arguments = match args {
        Value::Object(_) => args.to_string(),
        // Some models write the arguments as a JSON string, as OpenAI sends them.
        Value::String(s) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)?
            .to_string(),
        _ => return None,
    };
    Some(ParsedCall { name, arguments })
}

fn parse_hermes(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let first = text.find(OPEN)?;
    let mut content = text[..first].to_owned();
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(at) = rest.find(OPEN) {
        content.push_str(&rest[..at]);
        let body = &rest[at + OPEN.len()..];
        let (json, after) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        calls.push(call_of(&serde_json::from_str(json.trim()).ok()?)?);
        rest = after;
    }
    content.push_str(rest);
    Some((content, calls))
}

fn parse_llama3(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    let t = text.trim();
    let t = t.strip_prefix("<|python_tag|>").unwrap_or(t).trim();
    let v: Value = serde_json::from_str(t).ok()?;
    Some((String::new(), vec![call_of(&v)?]))
}

fn parse_mistral(text: &str) -> Option<(String, Vec<ParsedCall>)> {
    const TAG: &str = "[TOOL_CALLS]";
    let at = text.find(TAG)?;
    let v: Value = serde_json::from_str(text[at + TAG.len()..].trim()).ok()?;
    let calls = match &v {
        Value::Array(a) => a.iter().map(call_of).collect::<Option<Vec<_>>>()?,
        Value::Object(_) => vec![call_of(&v)?],
        _ => return None,
    };
    Some((text[..at].to_owned(), calls))
}

/// The constraint for a request offering `tools` in `format`: a Lark grammar (llguidance's
/// dialect, whose `%json` embeds each function's `parameters` schema). `special` gives the id
/// of a special token by its text, so that a marker the vocabulary holds as one token (Qwen's
/// `<tool_call>`) is produced as that token.
pub fn tool_grammar(
    format: ToolFormat,
    tools: &[ToolDef],
    choice: &ToolChoice,
    parallel: bool,
    special: impl Fn(&str) -> Option<u32>,
) -> Result<ConstraintSpec, ToolError> {
    let allowed: Vec<&ToolDef> = match choice {
        ToolChoice::Function(n) => {
            let t = tools
                .iter()
                .find(|t| &t.name == n)
                .ok_or_else(|| ToolError::UnknownChoice(n.clone()))?;
            vec![t]
        }
        ToolChoice::Auto | ToolChoice::Required => tools.iter().collect(),
    };
    let key = format.arguments_key();
    let variants: Vec<Value> = allowed
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, key: t.parameters},
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let one = if variants.len() == 1 {
        variants[0].clone()
    } else {
        json!({"anyOf": variants})
    };
    let guidance =
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    let lit = |text: &str| match special(text) {
        Some(id) => format!("<[{id}]>"),
        None => serde_json::to_string(text).unwrap_or_default(),
    };
    let mut g = String::new();
    let text_rule = match format {
        ToolFormat::Hermes => r#"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/"#,
        ToolFormat::Llama3Json => r#"TEXT: /(?s:[^{].*)/"#,
        ToolFormat::Mistral => r#"TEXT: /(?s:.+)/ & ~/(?s:.*\[TOOL_CALLS\].*)/"#,
    };
    g.push_str(match choice {
        ToolChoice::Auto => "start: TEXT | calls\n",
        ToolChoice::Required | ToolChoice::Function(_) => "start: calls\n",
    });
    match format {
        ToolFormat::Hermes => {
            let mut schema = one;
            schema["x-guidance"] = guidance;
            g.push_str(if parallel {
                "calls: call (\"\\n\" call)*\n"
            } else {
                "calls: call\n"
            });
            g.push_str(&format!(
                "call: {} \"\\n\" %json {} \"\\n\" {}\n",
                lit("<tool_call>"),
                schema,
                lit("</tool_call>")
            ));
        }
        ToolFormat::Llama3Json => {
            let mut schema = one;
            schema["x-guidance"] = guidance;
            g.push_str(&format!("calls: %json {schema}\n"));
        }
        ToolFormat::Mistral => {
            let mut list = json!({"type": "array", "items": one, "minItems": 1});
            if !parallel {
                list["maxItems"] = json!(1);
            }
            list["x-guidance"] = guidance;
            // `[TOOL_CALLS] [` as the template writes earlier calls.
            g.push_str(&format!(
                "calls: {} \" \" %json {list}\n",
                lit("[TOOL_CALLS]")
            ));
        }
    }
    g.push_str(text_rule);
    g.push('\n');
    Ok(ConstraintSpec {
        kind: ConstraintKind::ToolCalls,
        source: g,
    })
}

/// The `tojson` filter as Hugging Face's chat templates and llama-cpp-python (0.3.36) define
/// it: Python's `json.dumps(value, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, each a keyword argument — keys in the order given, text as it is (not
/// Jinja2's own filter, which sorts keys and escapes HTML).
pub fn tojson_filter(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let style = PyJson {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        item_sep: separators
            .as_ref()
            .and_then(|s| s.first().cloned())
            .unwrap_or_else(|| {
                if indent.is_some() {
                    ",".into()
                } else {
                    ", ".into()
                }
            }),
        key_sep: separators
            .as_ref()
            .and_then(|s| s.get(1).cloned())
            .unwrap_or_else(|| ": ".into()),
    };
    Ok(minijinja::Value::from_safe_string(style.dumps(&v)))
}

/// `json.dumps(v)` with Hugging Face's defaults (keys in order, non-ASCII as it is).
pub fn python_json(v: &Value, indent: Option<usize>) -> String {
    PyJson {
        indent,
        sort_keys: false,
        ensure_ascii: false,
        item_sep: if indent.is_some() {
            ",".into()
        } else {
            ", ".into()
        },
        key_sep: ": ".into(),
    }
    .dumps(v)
}

/// Python's `json.dumps` options.
struct PyJson {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
    item_sep: String,
    key_sep: String,
}

impl PyJson {
    fn dumps(&self, v: &Value) -> String {
        let mut out = String::new();
        self.write(v, 0, &mut out);
        out
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    }

    fn write(&self, v: &Value, level: usize, out: &mut String) {
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => out.push_str(&n.to_string()),
            Value::String(s) => self.write_str(s, out),
            Value::Array(a) if a.is_empty() => out.push_str("[]"),
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Value::Object(o) if o.is_empty() => out.push_str("{}"),
            Value::Object(o) => {
                let mut keys: Vec<&String> = o.keys().collect();
                if self.sort_keys {
                    keys.sort();
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write_str(k, out);
                    out.push_str(&self.key_sep);
                    self.write(&o[k.as_str()], level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, name: &str, arguments: Value) -> ToolCallMessage {
        ToolCallMessage {
            id: id.into(),
            kind: "function".into(),
            function: ToolCallFunction {
                name: name.into(),
                arguments,
            },
        }
    }

    #[test]
    fn a_history_polyfilled_for_a_template_without_tools_alternates_and_parses_back() {
        let calls = vec![
            call("c1", "get_weather", json!({"city": "Oslo"})),
            call("c2", "get_weather", json!({"city": "Bergen"})),
        ];
        let mut assistant = ChatMessage::new("assistant", "");
        assistant.tool_calls = calls.clone();
        let result = |id: &str, text: &str| ChatMessage {
            tool_call_id: Some(id.into()),
            ..ChatMessage::new("tool", text)
        };
        let history = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Weather?"),
            assistant,
            result("c1", "4 C"),
            result("c2", "7 C"),
        ];
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
        ] {
            let out = format.polyfill_history(&history);
            let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
            assert_eq!(roles, ["system", "user", "assistant", "user"], "{format:?}");
            assert!(out.iter().all(|m| m.tool_calls.is_empty()));
            assert!(
                out[3].content.contains("4 C") && out[3].content.contains("7 C"),
                "{format:?}: both results in one turn: {}",
                out[3].content
            );
            // What the history says the model wrote is what the parser reads back (Llama 3's
            // JSON format carries one call per turn: the history writes one per line).
            let written = match format {
                ToolFormat::Llama3Json => out[2].content.lines().next().unwrap_or_default(),
                _ => &out[2].content,
            };
            let parsed = format.parse(written, &[weather()]);
            let n = if format == ToolFormat::Llama3Json {
                1
            } else {
                2
            };
            let want: Vec<ParsedCall> = calls[..n]
                .iter()
                .map(|c| ParsedCall {
                    name: c.function.name.clone(),
                    arguments: c.function.arguments.to_string(),
                })
                .collect();
            if n == 2 {
                assert_eq!(parsed.calls, want, "{format:?}: {}", out[2].content);
            }
            assert_eq!(parsed.calls.first(), want.first(), "{format:?}");
        }
        assert!(
            ToolFormat::Hermes
                .polyfill_history(&history)
                .iter()
                .any(|m| m.content.starts_with("<tool_response>\n4 C"))
        );
    }

    fn weather() -> ToolDef {
        ToolDef {
            name: "get_weather".into(),
            description: Some("Weather in a city".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
            strict: false,
        }
    }

    #[test]
    fn python_json_matches_json_dumps() {
        let v = json!({"b": [1, 2.5, "x<y & 'z'\n"], "a": {"é": null, "k": true}, "c": []});
        assert_eq!(
            python_json(&v, None),
            r#"{"b": [1, 2.5, "x<y & 'z'\n"], "a": {"é": null, "k": true}, "c": []}"#
        );
        assert_eq!(
            python_json(&json!({"b": [1, {}], "a": "😀"}), Some(2)),
            "{\n  \"b\": [\n    1,\n    {}\n  ],\n  \"a\": \"😀\"\n}"
        );
        let ascii = PyJson {
            indent: None,
            sort_keys: true,
            ensure_ascii: true,
            item_sep: ",".into(),
            key_sep: ":".into(),
        };
        assert_eq!(
            ascii.dumps(&json!({"b": "😀", "a": 1})),
            r#"{"a":1,"b":"\ud83d\ude00"}"#
        );
    }

    #[test]
    fn formats_parse_their_calls() {
        let tools = [weather()];
        let h = ToolFormat::Hermes.parse(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
            &tools,
        );
        assert_eq!(h.content, None);
        assert_eq!(h.calls.len(), 2);
        assert_eq!(h.calls[1].arguments, r#"{"city":"Rome"}"#);
        let l = ToolFormat::Llama3Json.parse(
            r#"{"name": "get_weather", "parameters": {"city": "Oslo"}}"#,
            &tools,
        );
        assert_eq!(l.calls[0].name, "get_weather");
        let m = ToolFormat::Mistral.parse(
            r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]"#,
            &tools,
        );
        assert_eq!(m.calls[0].arguments, r#"{"city":"Oslo"}"#);
        // Not a call of an offered function, or not JSON: text, whole.
        for (f, text) in [
            (
                ToolFormat::Hermes,
                "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
            ),
            (
                ToolFormat::Hermes,
                "<tool_call>{\"name\": \"get_weather\", ",
            ),
            (ToolFormat::Llama3Json, "{not json"),
            (ToolFormat::Mistral, "It is sunny."),
        ] {
            let p = f.parse(text, &tools);
            assert!(p.calls.is_empty(), "{text}");
            assert_eq!(p.content.as_deref(), Some(text));
        }
    }

    #[test]
    fn formats_are_found_in_templates() {
        assert_eq!(
            ToolFormat::detect("{{ '<|im_start|>' }}"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::detect("<|start_header_id|>"),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::detect("[INST]"), Some(ToolFormat::Mistral));
        assert_eq!(ToolFormat::detect("### User:"), None);
    }

    #[test]
    fn a_named_choice_must_be_offered() {
        let e = tool_grammar(
            ToolFormat::Hermes,
            &[weather()],
            &ToolChoice::Function("nope".into()),
            true,
            |_| None,
        );
        assert_eq!(e, Err(ToolError::UnknownChoice("nope".into())));
    }
}

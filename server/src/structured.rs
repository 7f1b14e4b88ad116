//! The output constraint a request asks for: OpenAI's `response_format` (`text`,
//! `json_object`, `json_schema`) or vLLM's `structured_outputs` extension (`json`, `regex`,
//! `grammar` in llguidance's Lark, `choice`). At most one; each malformed shape is a 400 naming
//! its field. Compiling it is the engine crate's (`grammar::Grammars`), done off the async
//! workers by the caller.

use serde_json::Value;

use custody_runtime::grammar::{ConstraintKind, ConstraintSpec};

use crate::error::ApiError;

/// Most `choice` alternatives.
pub const MAX_CHOICES: usize = 1024;

/// The request's constraint, if any, and the field it came from.
pub fn parse(v: &Value) -> Result<(Option<ConstraintSpec>, &'static str), ApiError> {
    let rf = response_format(v.get("response_format"))?;
    let so = structured_outputs(v.get("structured_outputs"))?;
    match (rf, so) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "response_format and structured_outputs both ask for a constraint: send one",
        )
        .param("structured_outputs")),
        (Some(c), None) => Ok((Some(c), "response_format")),
        (None, Some(c)) => Ok((Some(c), "structured_outputs")),
        (None, None) => Ok((None, "response_format")),
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg).param("response_format")
}

fn response_format(v: Option<&Value>) -> Result<Option<ConstraintSpec>, ApiError> {
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(bad("response_format must be an object with a type")),
    };
    let ty = o.get("type").and_then(Value::as_str).unwrap_or("");
    let allowed: &[&str] = match ty {
        "text" | "json_object" => &["type"],
        "json_schema" => &["type", "json_schema"],
        other => {
            return Err(bad(format!(
                "response_format.type {other:?} is not supported (text, json_object, json_schema)"
            )));
        }
    };
    if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(format!("response_format: unknown field {k:?}")));
    }
    match ty {
        "text" => Ok(None),
        "json_object" => Ok(Some(ConstraintSpec {
            kind: ConstraintKind::JsonObject,
            source: String::new(),
        })),
        _ => json_schema(o.get("json_schema")).map(Some),
    }
}

/// `{"name", "description"?, "schema"?, "strict"?}`. `strict` true or false: either way the
/// schema is enforced (OpenAI's `false` only promises less). No schema: any JSON value.
fn json_schema(v: Option<&Value>) -> Result<ConstraintSpec, ApiError> {
    let Some(Value::Object(o)) = v else {
        return Err(bad("response_format.json_schema must be an object"));
    };
    for (k, val) in o {
        let ok = match k.as_str() {
            "name" => val.as_str().is_some_and(|n| {
                !n.is_empty()
                    && n.len() <= 64
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            }),
            "description" => val.is_string(),
            "schema" => val.is_object() || val.is_boolean(),
            "strict" => val.is_boolean() || val.is_null(),
            _ => {
                return Err(bad(format!(
                    "response_format.json_schema: unknown field {k:?}"
                )));
            }
        };
        if !ok {
            return Err(bad(format!(
                "response_format.json_schema.{k} is malformed (name: 1-64 of a-z, A-Z, 0-9, _ and -; \
                 schema: an object; strict: a boolean)"
            )));
        }
    }
    if !o.contains_key("name") {
        return Err(bad("response_format.json_schema.name is required"));
    }
    let schema = o.get("schema").cloned().unwrap_or(Value::Bool(true));
    Ok(ConstraintSpec {
        kind: ConstraintKind::JsonSchema,
        source: schema.to_string(),
    })
}

fn structured_outputs(v: Option<&Value>) -> Result<Option<ConstraintSpec>, ApiError> {
    let bad = |m: String| ApiError::bad_request(m).param("structured_outputs");
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(bad("structured_outputs must be an object".into())),
    };
    let set: Vec<(&String, &Value)> = o.iter().filter(|(_, v)| !v.is_null()).collect();
    let [(k, val)] = set.as_slice() else {
        return Err(bad(format!(
            "structured_outputs takes exactly one of json, regex, grammar, choice; got {}",
            set.len()
        )));
    };
    let text = || {
        val.as_str()
            .map(str::to_owned)
            .ok_or_else(|| bad(format!("structured_outputs.{k} must be a string")))
    };
    let spec = match k.as_str() {
        "json" => ConstraintSpec {
            kind: ConstraintKind::JsonSchema,
            source: match val {
                // A schema given as a string (vLLM takes both).
                Value::String(s) => s.clone(),
                other => other.to_string(),
            },
        },
        "regex" => ConstraintSpec {
            kind: ConstraintKind::Regex,
            source: text()?,
        },
        "grammar" => ConstraintSpec {
            kind: ConstraintKind::Lark,
            source: text()?,
        },
        "choice" => ConstraintSpec {
            kind: ConstraintKind::Regex,
            source: choice_regex(val).map_err(bad)?,
        },
        other => {
            return Err(bad(format!(
                "structured_outputs.{other} is not supported (json, regex, grammar, choice)"
            )));
        }
    };
    Ok(Some(spec))
}

/// `choice: ["a", "b"]` as the regex `(a|b)`, each alternative literal.
fn choice_regex(v: &Value) -> Result<String, String> {
    let Some(items) = v.as_array() else {
        return Err("structured_outputs.choice must be a list of strings".into());
    };
    if items.is_empty() || items.len() > MAX_CHOICES {
        return Err(format!(
            "structured_outputs.choice must hold 1 to {MAX_CHOICES} strings"
        ));
    }
    let mut alts = Vec::with_capacity(items.len());
    for it in items {
        let s = it
            .as_str()
            .filter(|s| !s.is_empty())
            .ok_or("structured_outputs.choice must hold non-empty strings")?;
        alts.push(regex_literal(s));
    }
    Ok(format!("({})", alts.join("|")))
}

/// `s` as a regex matching exactly it: every character outside `[A-Za-z0-9 _]` escaped
/// (`\u{…}` for the rest, which the regex syntax reads literally).
fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if c.is_ascii_alphanumeric() || c == ' ' || c == '_' {
            out.push(c);
        } else if c.is_ascii_punctuation() {
            out.push('\\');
            out.push(c);
        } else {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(body: &str) -> Result<(Option<ConstraintSpec>, &'static str), ApiError> {
        parse(&serde_json::from_str(body).expect("json"))
    }

    #[test]
    fn shapes_map_to_kinds() {
        let kind = |b: &str| p(b).expect(b).0.map(|c| c.kind);
        assert_eq!(kind(r#"{}"#), None);
        assert_eq!(kind(r#"{"response_format": {"type": "text"}}"#), None);
        assert_eq!(
            kind(r#"{"response_format": {"type": "json_object"}}"#),
            Some(ConstraintKind::JsonObject)
        );
        assert_eq!(
            kind(
                r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}"#
            ),
            Some(ConstraintKind::JsonSchema)
        );
        assert_eq!(
            kind(r#"{"structured_outputs": {"grammar": "start: \"a\""}}"#),
            Some(ConstraintKind::Lark)
        );
        let (c, param) =
            p(r#"{"structured_outputs": {"choice": ["yes", "no (1.5)"]}}"#).expect("choice");
        assert_eq!(param, "structured_outputs");
        assert_eq!(c.expect("set").source, r"(yes|no \(1\.5\))");
    }

    #[test]
    fn malformed_shapes_name_their_field() {
        for (body, param) in [
            (r#"{"response_format": {"type": "xml"}}"#, "response_format"),
            (
                r#"{"response_format": {"type": "json_schema"}}"#,
                "response_format",
            ),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}"#,
                "response_format",
            ),
            (
                r#"{"response_format": {"type": "json_object", "extra": 1}}"#,
                "response_format",
            ),
            (
                r#"{"structured_outputs": {"regex": "a", "grammar": "b"}}"#,
                "structured_outputs",
            ),
            (
                r#"{"structured_outputs": {"choice": []}}"#,
                "structured_outputs",
            ),
            (
                r#"{"structured_outputs": {"xml": "a"}}"#,
                "structured_outputs",
            ),
            (
                r#"{"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}"#,
                "structured_outputs",
            ),
        ] {
            let e = p(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }
}

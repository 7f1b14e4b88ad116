//! Decoding options on the engine itself, with the embedded model: output constraints compiled
//! by llguidance (`grammar`), log-probabilities (against llama.cpp's logits), logit biases and
//! penalties (`decoding`). Through the HTTP API and the `openai` client: `serve.rs`.

use std::sync::Arc;

use custody_runtime::decoding::{Decoding, LogitBias, TokenLogprobs};
use custody_runtime::engine::{Event, FinishReason, GenerateRequest};
use custody_runtime::grammar::{ConstraintKind, ConstraintSpec, Grammars};
use custody_runtime::{ChatMessage, SamplingParams};
use custody_tests::{fixture, read_npy_f32};

use crate::reference::ids;
use crate::{engine_with, small_cfg, tokenizer};

struct Output {
    tokens: Vec<u32>,
    logprobs: Vec<Option<Box<TokenLogprobs>>>,
    finish: Option<FinishReason>,
}

fn run(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams, d: Decoding) -> Output {
    let tok = tokenizer();
    let mut e = engine_with(small_cfg());
    let id = e
        .submit(GenerateRequest {
            decoding: d,
            prompt,
            max_tokens,
            sampling,
            stop_ids: tok.stop_ids.clone(),
            tenant: "tenant-a".into(),
            cache: None,
        })
        .expect("admitted");
    let mut out = Output {
        tokens: Vec::new(),
        logprobs: Vec::new(),
        finish: None,
    };
    while e.has_work() {
        for ev in e.step() {
            match ev {
                Event::Token {
                    id: r,
                    token,
                    logprobs,
                } if r == id => {
                    out.tokens.push(token);
                    out.logprobs.push(logprobs);
                }
                Event::Finished { id: r, reason, .. } if r == id => out.finish = Some(reason),
                Event::Failed { error, .. } => panic!("integrity failure: {error}"),
                Event::Aborted { reason, .. } => panic!("aborted: {reason}"),
                _ => {}
            }
        }
    }
    out
}

fn grammars() -> Grammars {
    let tok = Arc::new(tokenizer());
    let eos = tok.eos_id.expect("eos");
    Grammars::new(tok, eos).expect("trie")
}

fn chat(text: &str) -> Vec<u32> {
    tokenizer()
        .encode_chat(&[ChatMessage::new("user", text)])
        .expect("chat")
}

/// 160 tokens sampled at temperature 0.8 under `spec`.
fn sample_constrained(spec: ConstraintSpec, prompt: Vec<u32>, seed: u64) -> Output {
    let c = grammars().compile(spec).expect("compiles");
    run(
        prompt,
        160,
        SamplingParams {
            temperature: 0.8,
            seed,
            ..SamplingParams::default()
        },
        Decoding {
            constraint: Some(c),
            ..Decoding::default()
        },
    )
}

fn constrained(kind: ConstraintKind, source: &str, prompt: Vec<u32>, seed: u64) -> String {
    let spec = ConstraintSpec {
        kind,
        source: source.into(),
    };
    let out = sample_constrained(spec, prompt, seed);
    assert_eq!(
        out.finish,
        Some(FinishReason::Stop),
        "a constrained output ends by completing (not truncated): {:?}",
        tokenizer().decode(&out.tokens)
    );
    tokenizer().decode(&out.tokens).expect("decode")
}

#[test]
fn a_json_schema_constrains_every_sampled_output() {
    let schema = r#"{"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "river": {"enum": ["Seine", "Thames", "Danube"]}},
        "required": ["city", "population", "river"], "additionalProperties": false}"#;
    let prompt = chat("Describe Paris as JSON.");
    for seed in [1, 2, 3] {
        let text = constrained(ConstraintKind::JsonSchema, schema, prompt.clone(), seed);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!("seed {seed}: not JSON ({e}): {text:?}");
        });
        let o = v.as_object().expect("an object");
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["city"].as_str().is_some_and(|c| c.chars().count() <= 24));
        assert!(o["population"].as_u64().is_some_and(|p| p <= 100_000_000));
        assert!(["Seine", "Thames", "Danube"].contains(&o["river"].as_str().expect("river")));
    }
}

/// A mask computed ahead (on the mask pool, while the forward pass would run) is the mask
/// computed on the step: the same walk through a schema, once with each mask given time to be
/// computed ahead, once with computing ahead off, allows the same tokens at every step.
#[test]
fn masks_computed_ahead_equal_masks_computed_on_the_step() {
    use custody_runtime::grammar::ahead;
    let vocab = tokenizer().vocab_size();
    let walk = |ahead_on: bool| -> Vec<Vec<bool>> {
        ahead::set_enabled(ahead_on);
        let mut c = grammars()
            .compile(ConstraintSpec {
                kind: ConstraintKind::JsonSchema,
                source:
                    r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                    "n": {"type": "integer"}}, "required": ["name", "n"]}"#
                        .into(),
            })
            .expect("compiles");
        let mut masks = Vec::new();
        for step in 0..40 {
            if ahead_on {
                // Time for the job to run before the step asks (it would run during the
                // forward pass); if the host is too busy to run it, the step computes it.
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            let mut logits = vec![0.0f32; vocab];
            c.mask(&mut logits).expect("mask");
            let allowed: Vec<bool> = logits.iter().map(|l| l.is_finite()).collect();
            // Walk by the allowed ids in turn (varies the states visited).
            let ids: Vec<usize> = (0..vocab).filter(|&i| allowed[i]).collect();
            assert!(!ids.is_empty(), "step {step}: a mask allows something");
            masks.push(allowed);
            if c.is_complete() {
                break;
            }
            c.advance(ids[(step * 7) % ids.len()] as u32)
                .expect("advance");
        }
        ahead::set_enabled(true);
        masks
    };
    let (with, without) = (walk(true), walk(false));
    assert!(with.len() > 10, "{} steps", with.len());
    assert_eq!(with, without);
}

#[test]
fn a_regex_and_a_lark_grammar_constrain_the_output() {
    let prompt = chat("What is the phone number?");
    let text = constrained(
        ConstraintKind::Regex,
        r"[0-9]{3}-[0-9]{4}",
        prompt.clone(),
        5,
    );
    assert!(
        text.len() == 8
            && text.as_bytes()[3] == b'-'
            && text.replace('-', "").parse::<u32>().is_ok(),
        "{text:?}"
    );
    let lark = r#"start: answer "." 
answer: "yes" | "no" | "maybe""#;
    let text = constrained(ConstraintKind::Lark, lark, prompt, 6);
    assert!(
        ["yes.", "no.", "maybe."].contains(&text.as_str()),
        "{text:?}"
    );
}

#[test]
fn a_schema_the_library_cannot_compile_is_refused_with_its_message() {
    let g = grammars();
    for (kind, source, needle) in [
        (ConstraintKind::JsonSchema, "{", "not valid JSON"),
        (ConstraintKind::JsonSchema, "[1]", "object or a boolean"),
        (
            ConstraintKind::JsonSchema,
            r##"{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}"##,
            "cannot compile",
        ),
        (
            ConstraintKind::Lark,
            "start: undefined_rule",
            "cannot compile",
        ),
        (ConstraintKind::Regex, "[a-", "cannot compile"),
    ] {
        let e = g
            .compile(ConstraintSpec {
                kind,
                source: source.into(),
            })
            .expect_err(source);
        assert!(e.to_string().contains(needle), "{source}: {e}");
    }
    let deep = format!("{}{{}}{}", r#"{"items": "#.repeat(70), "}".repeat(70));
    let e = g
        .compile(ConstraintSpec {
            kind: ConstraintKind::JsonSchema,
            source: deep,
        })
        .expect_err("too deep");
    assert!(e.to_string().contains("nests deeper"), "{e}");
}

/// `log_softmax` of llama.cpp's logits for the raw prompt's last position, against the engine's
/// log-probabilities of its first greedy token and the 20 alternatives.
#[test]
fn logprobs_are_llama_cpps_log_softmax() {
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("llamacpp-smollm2/raw_prompt_ref.json")).expect("fixture"),
    )
    .expect("json");
    let (shape, theirs) = read_npy_f32(&fixture("llamacpp-smollm2/ref_logits.npy"));
    let vocab = shape[1];
    let last = &theirs[(shape[0] - 1) * vocab..shape[0] * vocab];
    let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = f64::from(max)
        + last
            .iter()
            .map(|&l| f64::from(l - max).exp())
            .sum::<f64>()
            .ln();
    let out = run(
        ids(&r["prompt_ids"]),
        1,
        SamplingParams::default(),
        Decoding {
            logprobs: Some(20),
            ..Decoding::default()
        },
    );
    let lp = out.logprobs[0].as_ref().expect("asked for");
    let want = |t: u32| (f64::from(last[t as usize]) - log_z) as f32;
    assert!((lp.logprob - want(out.tokens[0])).abs() < 1e-4);
    assert_eq!(lp.top.len(), 20);
    assert_eq!(
        lp.top[0].token, out.tokens[0],
        "greedy picks the most likely"
    );
    for a in &lp.top {
        assert!(
            (a.logprob - want(a.token)).abs() < 1e-4,
            "token {}: {} vs {}",
            a.token,
            a.logprob,
            want(a.token)
        );
    }
    assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
}

#[test]
fn logit_bias_and_penalties_change_what_is_sampled() {
    let prompt = chat("Count from one to ten.");
    let plain = run(
        prompt.clone(),
        12,
        SamplingParams::default(),
        Decoding::default(),
    );
    // A bias of -100 on the first greedy token: it never appears.
    let banned = plain.tokens[0];
    let biased = run(
        prompt.clone(),
        12,
        SamplingParams::default(),
        Decoding {
            logit_bias: vec![LogitBias {
                token: banned,
                bias: -100.0,
            }],
            ..Decoding::default()
        },
    );
    assert!(!biased.tokens.contains(&banned));
    // A strong frequency penalty: no token more than twice in 24 greedy tokens... unless the
    // plain run already repeats less; either way the penalised run repeats no more than it.
    let repeats = |t: &[u32]| {
        let mut c = std::collections::HashMap::new();
        for x in t {
            *c.entry(x).or_insert(0) += 1;
        }
        c.values().copied().max().unwrap_or(0)
    };
    let long = run(
        prompt.clone(),
        24,
        SamplingParams::default(),
        Decoding::default(),
    );
    let penalised = run(
        prompt,
        24,
        SamplingParams::default(),
        Decoding {
            frequency_penalty: 2.0,
            presence_penalty: 2.0,
            ..Decoding::default()
        },
    );
    assert!(
        repeats(&long.tokens) > 2,
        "the plain run repeats: {:?}",
        long.tokens
    );
    assert!(
        repeats(&penalised.tokens) < repeats(&long.tokens),
        "{:?} vs {:?}",
        penalised.tokens,
        long.tokens
    );
}

/// Every tool-call format's grammar compiles and makes the sampled output parse: calls of the
/// offered functions with arguments that match their schemas (`required`, a named function),
/// or, with `auto`, either such calls or text that the parser leaves whole.
#[test]
fn tool_grammars_make_every_call_parse_in_each_format() {
    use custody_runtime::tools::{ToolChoice, ToolDef, ToolFormat, tool_grammar};
    let tools = vec![
        ToolDef {
            name: "get_weather".into(),
            description: Some("Current weather in a city".into()),
            parameters: serde_json::json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}),
            strict: true,
        },
        ToolDef {
            name: "add".into(),
            description: None,
            parameters: serde_json::json!({"type": "object", "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"], "additionalProperties": false}),
            strict: false,
        },
    ];
    let tok = tokenizer();
    let prompt = chat("What is the weather in Oslo?");
    let mut auto_calls = 0;
    for format in [
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::Mistral,
    ] {
        for (choice, seed) in [
            (ToolChoice::Required, 11),
            (ToolChoice::Function("add".into()), 12),
            (ToolChoice::Auto, 13),
        ] {
            // One call per answer: with parallel calls a 135M model repeats its call until
            // max_tokens.
            let spec = tool_grammar(format, &tools, &choice, false, |t| tok.special_token_id(t))
                .expect("grammar");
            let out = sample_constrained(spec, prompt.clone(), seed);
            let text = tok.decode(&out.tokens).expect("decode");
            let parsed = format.parse(&text, &tools);
            let what = format!("{} {:?}: {text:?}", format.name(), choice);
            if choice == ToolChoice::Auto && parsed.calls.is_empty() {
                // Text (which may run to max_tokens): never the start of a call.
                assert!(!text.trim_start().starts_with(format.trigger()), "{what}");
                continue;
            }
            assert_eq!(out.finish, Some(FinishReason::Stop), "{what}");
            if choice == ToolChoice::Auto {
                auto_calls += 1;
            }
            assert!(!parsed.calls.is_empty(), "{what}");
            for c in &parsed.calls {
                let args: serde_json::Value =
                    serde_json::from_str(&c.arguments).expect("arguments are JSON");
                match (c.name.as_str(), &choice) {
                    ("add", _) => {
                        assert!(args["a"].is_i64() && args["b"].is_i64(), "{what}");
                    }
                    ("get_weather", ToolChoice::Required | ToolChoice::Auto) => {
                        assert!(
                            args["city"]
                                .as_str()
                                .is_some_and(|c| c.chars().count() <= 20)
                        );
                        assert!(
                            ["celsius", "fahrenheit"]
                                .contains(&args["unit"].as_str().expect("unit"))
                        );
                    }
                    _ => panic!("a call outside the choice: {what}"),
                }
            }
        }
    }
    eprintln!("auto: {auto_calls} of 3 formats called a tool");
}

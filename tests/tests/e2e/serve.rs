//! `custody serve` end to end: the official `openai` Python client against the server,
//! bounded fuzz of the JSON endpoints, and a graceful shutdown that drains a live stream and
//! seals the audit log. Every request id the client saw is looked up in the sealed Parquet.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use custody_audit::digest;
use custody_audit::writer::{AuditWriter, WriterConfig};
use custody_runtime::config::{PrefixCacheSection, PublicScopeSection};
use custody_runtime::{Engine, EngineConfig};
use custody_server::client;
use custody_server::config::{ServeSection, TenantSection};
use custody_server::tenants::hash_key;
use custody_server::{AuditStats, ServeOptions};

use crate::audit::{col_str, col_u32, col_u64, read_table, tmp_dir};
use crate::{engine_with, tokenizer};

pub(crate) const KEY: &str = "sk-test-acme";
const KEY_TINY: &str = "sk-test-tiny";
const MODEL_ID: &str = "smollm2-test";
const CONTEXT: usize = 2048;
const NODE: u32 = 3;

#[derive(Debug)]
struct Stats(Arc<AuditWriter>);

impl AuditStats for Stats {
    fn queue_depth(&self) -> u64 {
        self.0.queue_depth()
    }
    fn queue_capacity(&self) -> u64 {
        self.0.queue_capacity() as u64
    }
    fn dropped_total(&self) -> u64 {
        self.0.dropped_total()
    }
}

fn serve_cfg() -> ServeSection {
    ServeSection {
        listen: "127.0.0.1:0".into(),
        model_name: MODEL_ID.into(),
        // Often enough to run during the client test, rarely enough not to crowd it out.
        canary_interval_s: 5,
        drain_timeout_s: 60,
        tenants: vec![
            TenantSection {
                id: "acme".into(),
                keys_sha256: vec![hash_key(KEY)],
                max_concurrent: 8,
                tokens_per_minute: 0,
            },
            TenantSection {
                id: "tiny".into(),
                keys_sha256: vec![hash_key(KEY_TINY)],
                max_concurrent: 1,
                tokens_per_minute: 1000,
            },
        ],
        ..ServeSection::default()
    }
}

/// A test server's prefix-cache options: `[prefix_cache]`, the unsafe shared-cache switch,
/// `[kv_offload]`.
#[derive(Default)]
pub(crate) struct CacheOpts {
    pub(crate) prefix_cache: PrefixCacheSection,
    pub(crate) unsafe_shared: bool,
    pub(crate) kv_offload: Option<custody_runtime::offload::OffloadSetup>,
}

/// A server in this process on a loopback port, auditing into a temporary root.
pub(crate) struct TestServer {
    url: String,
    /// The operator's listener (`/metrics`): never the tenants' port.
    metrics_url: String,
    root: crate::audit::TmpDir,
    writer: Arc<AuditWriter>,
    rt: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<Result<Engine, custody_server::ServeError>>>,
}

impl TestServer {
    fn start(name: &str) -> Self {
        Self::start_with(name, serve_cfg())
    }

    fn start_with(name: &str, cfg: ServeSection) -> Self {
        Self::start_full(name, cfg, None)
    }

    /// `stats`: what `/metrics` and the back-pressure check see of the audit queue (default:
    /// the real writer's).
    fn start_full(name: &str, cfg: ServeSection, stats: Option<Arc<dyn AuditStats>>) -> Self {
        let engine = engine_with(EngineConfig {
            context_length: Some(CONTEXT),
            kv_budget_mib: 64,
            ..EngineConfig::default()
        });
        Self::start_engine(name, cfg, stats, engine, tokenizer())
    }

    /// A server with the prefix cache on, `prefix_cache` its namespaces' section, and
    /// `[unsafe_reproduction] shared_prefix_cache` armed or not.
    fn start_cache(
        name: &str,
        cfg: ServeSection,
        prefix_cache: PrefixCacheSection,
        unsafe_shared: bool,
    ) -> Self {
        let engine = engine_with(EngineConfig {
            context_length: Some(CONTEXT),
            kv_budget_mib: 64,
            prefix_cache: Some(true),
            ..EngineConfig::default()
        });
        Self::start_opts(
            name,
            cfg,
            None,
            engine,
            tokenizer(),
            CacheOpts {
                prefix_cache,
                unsafe_shared,
                kv_offload: None,
            },
        )
    }

    /// A server on another GGUF (its own context length and tokenizer).
    fn start_model(name: &str, model: &std::path::Path) -> Self {
        let m = custody_runtime::Model::load(model).expect("model");
        let tok = custody_runtime::Tokenizer::from_gguf(m.gguf()).expect("tokenizer");
        let cfg = EngineConfig {
            kv_budget_mib: 16,
            ..EngineConfig::default()
        };
        let engine = Engine::new(m, cfg).expect("engine");
        Self::start_engine(name, serve_cfg(), None, engine, tok)
    }

    fn start_engine(
        name: &str,
        cfg: ServeSection,
        stats: Option<Arc<dyn AuditStats>>,
        engine: Engine,
        tok: custody_runtime::Tokenizer,
    ) -> Self {
        Self::start_opts(name, cfg, stats, engine, tok, CacheOpts::default())
    }

    pub(crate) fn start_opts(
        name: &str,
        cfg: ServeSection,
        stats: Option<Arc<dyn AuditStats>>,
        engine: Engine,
        tok: custody_runtime::Tokenizer,
        cache: CacheOpts,
    ) -> Self {
        let CacheOpts {
            prefix_cache,
            unsafe_shared,
            kv_offload,
        } = cache;
        let root = tmp_dir(&format!("serve-{name}"));
        let key = digest::generate_key().expect("key");
        let writer = Arc::new(
            AuditWriter::open(WriterConfig::new(root.join("audit"), NODE, key)).expect("writer"),
        );
        let engine = engine.with_audit(writer.clone());
        let pool = custody_runtime::par::ThreadPool::new(2).expect("pool");
        let prepared = custody_server::prepare(engine, pool, tok, &cfg).expect("prepare");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let metrics = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let metrics_url = format!("http://{}", metrics.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let opts = ServeOptions {
            metrics: Some(metrics),
            cfg,
            node: NODE,
            audit: Some(stats.unwrap_or_else(|| Arc::new(Stats(writer.clone())))),
            events: None,
            prefix_cache,
            unsafe_shared_prefix_cache: unsafe_shared,
            kv_offload,
            audit_disabled: false,
            proofs: None,
        };
        let done = rt.spawn(custody_server::serve(
            listener,
            prepared,
            opts,
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            url,
            metrics_url,
            root,
            writer,
            rt,
            stop: Some(stop),
            done: Some(done),
        }
    }

    fn get(&self, path: &str) -> client::Response {
        client::request(&self.url, "GET", path, None, None, Duration::from_secs(60)).expect(path)
    }

    fn post(&self, path: &str, key: &str, body: &[u8]) -> client::Response {
        client::request(
            &self.url,
            "POST",
            path,
            Some(key),
            Some(body),
            Duration::from_secs(300),
        )
        .expect(path)
    }

    pub(crate) fn metric(&self, name: &str) -> f64 {
        let r = client::request(
            &self.metrics_url,
            "GET",
            "/metrics",
            None,
            None,
            Duration::from_secs(60),
        )
        .expect("/metrics");
        let text = String::from_utf8(r.body).expect("utf8");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} not in:\n{text}"))
    }

    /// SIGTERM's path: drain, stop the engine, seal the log. Returns the audit root (kept on
    /// disk while the returned value lives).
    pub(crate) fn stop(mut self) -> Sealed {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let done = self.done.take().expect("running");
        let engine = self
            .rt
            .block_on(done)
            .expect("serve task")
            .expect("serve result");
        drop(engine);
        self.writer.close().expect("seal the audit log");
        let audit = self.root.join("audit");
        let r = digest::verify(&audit, None, None, None);
        assert!(r.ok(), "audit verify: {:?}", r.problems);
        assert!(r.live_segments.is_empty(), "everything sealed at shutdown");
        Sealed {
            audit,
            _root: self.root,
        }
    }
}

/// A stopped server's sealed audit root; its temporary directory lives as long as this does.
pub(crate) struct Sealed {
    audit: PathBuf,
    _root: crate::audit::TmpDir,
}

impl std::ops::Deref for Sealed {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.audit
    }
}

/// The `detail` of every `node_events` row of kind `kind`.
fn node_events(audit: &std::path::Path, kind: &str) -> Vec<String> {
    read_table(audit, "node_events")
        .iter()
        .flat_map(|b| {
            let (ev, d) = (col_str(b, "event"), col_str(b, "detail"));
            (0..ev.len())
                .filter(|&i| ev[i].as_deref() == Some(kind))
                .map(|i| d[i].clone().unwrap_or_default())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Requests table: request id → (tenant, lifecycle events).
fn requests(audit: &std::path::Path) -> BTreeMap<u64, (String, Vec<String>)> {
    let mut out: BTreeMap<u64, (String, Vec<String>)> = BTreeMap::new();
    for b in read_table(audit, "requests") {
        let (ids, tenants, events) = (
            col_u64(&b, "request_id"),
            col_str(&b, "tenant"),
            col_str(&b, "event"),
        );
        for i in 0..ids.len() {
            let e = out.entry(ids[i]).or_default();
            e.0 = tenants[i].clone().unwrap_or_default();
            e.1.push(events[i].clone().unwrap_or_default());
        }
    }
    out
}

fn engine_id(request_id: &str) -> u64 {
    let rest = request_id
        .strip_prefix(&format!("req-{NODE}-"))
        .unwrap_or_else(|| panic!("{request_id:?} is not an engine request id of node {NODE}"));
    rest.parse().expect("numeric id")
}

pub(crate) fn python_with_openai() -> &'static str {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "python3 with the `openai` package is required: run scripts/setup.sh (pip install openai)"
    );
    "python3"
}

#[test]
fn openai_python_client_against_the_server() {
    let py = python_with_openai();
    let srv = TestServer::start("openai");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/openai_client.py");
    let out = Command::new(py)
        .arg(&script)
        .env("CUSTODY_URL", &srv.url)
        .env("CUSTODY_KEY", KEY)
        .env("CUSTODY_KEY_TINY", KEY_TINY)
        .env("CUSTODY_MODEL_ID", MODEL_ID)
        .env("CUSTODY_CONTEXT", CONTEXT.to_string())
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai client test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: BTreeMap<String, String> =
        serde_json::from_str(stdout.lines().last().expect("ids line")).expect("ids json");

    // The canary runs every 5 s with live traffic; by now it has passed at least once.
    let t0 = Instant::now();
    while srv.metric("custody_canary_runs_total{result=\"pass\"}") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no canary run");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        srv.metric("custody_canary_runs_total{result=\"fail\"}"),
        0.0
    );
    assert_eq!(srv.metric("custody_canary_ok"), 1.0);
    assert_eq!(srv.metric("custody_integrity_violations_total"), 0.0);
    assert!(
        srv.metric(
            "custody_requests_total{tenant=\"acme\",endpoint=\"chat_completions\",status=\"200\"}"
        ) >= 2.0
    );
    assert_eq!(
        srv.metric(
            "custody_requests_total{tenant=\"_unauthenticated\",endpoint=\"chat_completions\",status=\"401\"}"
        ),
        1.0
    );
    assert!(srv.metric("custody_time_to_first_token_seconds_count") >= 6.0);
    assert!(srv.metric("custody_kv_pages_total") > 0.0);
    // `custody validate`'s check, over HTTP, against this process's reference.
    let report = client::validate(&srv.url, KEY, &golden_reference()).expect("validate");
    assert!(report.pass(), "{report:?}");

    let audit = srv.stop();
    let reqs = requests(&audit);
    // Served requests are in the log under the id the client got, with the tenant.
    let chat = &reqs[&engine_id(&ids["chat"])];
    assert_eq!(chat.0, "acme");
    assert_eq!(chat.1, ["admitted", "finished"]);
    // The over-length prompt was refused at admission: recorded, nothing allocated.
    let over = engine_id(&ids["over_length"]);
    assert_eq!(reqs[&over].1, ["rejected"]);
    let pages = read_table(&audit, "page_events");
    assert!(
        pages
            .iter()
            .all(|b| col_u64(&b.clone(), "request_id").iter().all(|&r| r != over)),
        "a rejected request touched a page"
    );
    // A refused-before-admission id is never an engine id.
    assert!(ids["wrong_key"].starts_with(&format!("refused-{NODE}-")));
    // Every tenant that reached the engine is a configured one or the server's own.
    for (id, (tenant, _)) in &reqs {
        assert!(
            ["acme", "tiny", "_canary", "_calibration"].contains(&tenant.as_str()),
            "request {id} has tenant {tenant:?}"
        );
    }
    // Canary results are audit events.
    let canary_events: usize = read_table(&audit, "node_events")
        .iter()
        .map(|b| {
            col_str(b, "event")
                .iter()
                .filter(|e| e.as_deref() == Some("canary"))
                .count()
        })
        .sum();
    assert!(canary_events >= 1, "no canary event in node_events");
}

/// Structured outputs (the client's `parse` with a pydantic model, a corpus of 50+ JSON
/// schemas each output validated by `jsonschema`, regex and choice), log-probabilities whole
/// and streamed, `logit_bias`, and every refusal's `param`: `python/structured_outputs.py`.
#[test]
fn structured_outputs_logprobs_and_refusals_through_the_openai_client() {
    let srv = TestServer::start("structured");
    let stdout = run_client_script("structured_outputs.py", &srv.url, &[]);
    eprintln!("{stdout}");
    assert_eq!(srv.metric("custody_integrity_violations_total"), 0.0);
    let audit = srv.stop();
    // Every constrained or logprob request has its `request_decoding` row, the constraint by
    // kind and hash: the schemas' 52 + the stream + `parse`'s, the regex by its hash.
    let rows = read_table(&audit, "request_decoding");
    let kinds: Vec<Option<String>> = rows
        .iter()
        .flat_map(|b| col_str(b, "constraint_kind"))
        .collect();
    let hashes: Vec<Option<String>> = rows
        .iter()
        .flat_map(|b| col_str(b, "constraint_sha256"))
        .collect();
    let tops: Vec<Option<u32>> = rows
        .iter()
        .flat_map(|b| col_u32(b, "top_logprobs"))
        .collect();
    let count = |k: &str| kinds.iter().filter(|x| x.as_deref() == Some(k)).count();
    assert!(count("json_schema") >= 54, "{kinds:?}");
    assert!(
        count("json_object") >= 6 && count("regex") >= 2,
        "{kinds:?}"
    );
    let phone = custody_runtime::grammar::ConstraintSpec {
        kind: custody_runtime::grammar::ConstraintKind::Regex,
        source: "[0-9]{3}-[0-9]{4}".into(),
    };
    assert!(
        hashes.contains(&Some(phone.sha256_hex())),
        "the regex's hash"
    );
    assert!(
        tops.iter().filter(|t| **t == Some(5)).count() >= 2,
        "{tops:?}"
    );
    assert!(tops.contains(&Some(3)), "the text completion's logprobs=3");
    // `custody forensics request`'s timeline names the constraint.
    let figures: serde_json::Value =
        serde_json::from_str(stdout.lines().last().expect("figures")).expect("json");
    let id = engine_id(figures["regex_request"].as_str().expect("id"));
    let timeline = request_timeline(&audit, id);
    assert!(
        timeline.contains(&format!(
            "decoding regex constraint sha256 {}",
            phone.sha256_hex()
        )),
        "{timeline}"
    );
}

/// Tool calling with the official client (`python/tool_calls.py`: forced calls whole and
/// streamed, the loop's next turn, refusals by field) in each tool format, on the embedded
/// model: its own ChatML template (Hermes, tools in a system message), the Qwen 2.5 and 3
/// templates (from the per-architecture GGUFs) and the Llama 3 JSON and Mistral ones (the
/// `[model] chat_template_file` fixtures). (The per-architecture models themselves have
/// 256-token contexts: no tool prompt fits; `arch_models::tool_chats_render_as_llama_cpp_python_does`
/// checks their renderings.) The audit log's `request_tools` rows name what was offered and
/// called, and the request's timeline shows them.
#[test]
fn tool_calling_loop_through_the_openai_client_on_every_format() {
    let gguf_template = |m: &str| {
        let g = custody_runtime::gguf::Gguf::open(&custody_tests::fixture(&format!("arch/{m}")))
            .expect("gguf");
        let t = custody_runtime::Tokenizer::from_gguf(&g).expect("tokenizer");
        t.chat_template().expect("template").to_owned()
    };
    let file_template = |t: &str| {
        std::fs::read_to_string(custody_tests::fixture(&format!("tools/{t}"))).expect("template")
    };
    for (case, template, format) in [
        ("smollm2", None, "hermes"),
        ("qwen2", Some(gguf_template("qwen2.Q4_K_M.gguf")), "hermes"),
        ("qwen3", Some(gguf_template("qwen3.Q4_K_M.gguf")), "hermes"),
        (
            "llama3",
            Some(file_template("llama3-tools.jinja")),
            "llama3_json",
        ),
        (
            "mistral",
            Some(file_template("mistral-tools.jinja")),
            "mistral",
        ),
    ] {
        let mut tok = tokenizer();
        if let Some(t) = template {
            tok.set_chat_template(t);
        }
        let engine = engine_with(EngineConfig {
            context_length: Some(CONTEXT),
            kv_budget_mib: 64,
            ..EngineConfig::default()
        });
        let srv =
            TestServer::start_engine(&format!("tools-{case}"), serve_cfg(), None, engine, tok);
        let stdout = run_client_script("tool_calls.py", &srv.url, &[]);
        eprintln!("{case}: {}", stdout.lines().last().unwrap_or_default());
        assert_eq!(srv.metric("custody_integrity_violations_total"), 0.0);
        let audit = srv.stop();
        let rows = read_table(&audit, "request_tools");
        let col = |n: &str| -> Vec<String> {
            rows.iter()
                .flat_map(|b| col_str(b, n))
                .map(Option::unwrap_or_default)
                .collect()
        };
        let (formats, called, offered) = (col("format"), col("called"), col("offered"));
        // required, named, streamed named, none is not offered (no row), auto.
        assert_eq!(formats.len(), 4, "{case}: {formats:?}");
        assert!(formats.iter().all(|f| f == format), "{case}: {formats:?}");
        assert!(
            offered.iter().all(|o| o == "get_weather,add"),
            "{offered:?}"
        );
        assert!(
            called.iter().filter(|c| *c == "add").count() >= 2,
            "{called:?}"
        );
        let figures: serde_json::Value =
            serde_json::from_str(stdout.lines().last().expect("figures")).expect("json");
        let id = engine_id(figures["required_request"].as_str().expect("id"));
        let timeline = request_timeline(&audit, id);
        assert!(
            timeline.contains("tools required format ")
                && timeline.contains("offered [get_weather,add]"),
            "{case}: {timeline}"
        );
    }
}

/// Run `tests/python/<script>` (the official `openai` client) against the server at `url`,
/// with `env` added; its stdout, or a panic with its output when it fails.
/// The same tool-calling loop (`tests/python/tool_calls.py`: forced calls whole and streamed,
/// the call and its result in the history, an answer, the refusals) on each architecture's tiny
/// model (`tests/fixtures/arch`), with its own vocabulary and special tokens: Qwen 2.5 and 3
/// through their GGUF templates, Llama 3 and the SentencePiece model through their GGUF
/// templates (which do not render `tools`: the tools go into a system message in the format
/// the template implies) and through the tools templates of `tests/fixtures/tools`. Where
/// llama-cpp-python rendered the same chat (`gen_tool_fixtures.py`), the prompt the server
/// counts is llama.cpp's tokenization of that rendering, for the first turn and for the
/// follow-up whose call arrives as the API sends it (arguments as a JSON string).
#[test]
fn tool_calling_loop_on_each_architectures_tiny_model() {
    let dir = tmp_dir("tools-tiny");
    for (model, template, fixture, format) in [
        ("qwen2", None, Some("qwen2"), "hermes"),
        ("qwen3", None, Some("qwen3"), "hermes"),
        (
            "llama3",
            Some("llama3-tools.jinja"),
            Some("llama3"),
            "llama3_json",
        ),
        ("llama3", None, None, "llama3_json"),
        (
            "llama-spm",
            Some("mistral-tools.jinja"),
            Some("mistral"),
            "mistral",
        ),
        ("llama-spm", None, None, "mistral"),
    ] {
        let case = format!("{model}-{}", template.unwrap_or("gguf"));
        // The tiny models declare a 256-token context (their committed logits stay small); a
        // tools prompt is 550-1,460 of their tokens. The key only bounds admission here: no
        // rope scaling reads it, so the copy computes what the original computes.
        let gguf = dir.join(format!("{case}.gguf"));
        with_context_length(
            &custody_tests::fixture(&format!("arch/{model}.Q4_K_M.gguf")),
            &gguf,
            2048,
        );
        let m = custody_runtime::Model::load(&gguf).expect("model");
        let mut tok = custody_runtime::Tokenizer::from_gguf(m.gguf()).expect("tokenizer");
        if let Some(t) = template {
            let path = custody_tests::fixture(&format!("tools/{t}"));
            tok.set_chat_template(std::fs::read_to_string(path).expect("template"));
        }
        let engine = Engine::new(
            m,
            EngineConfig {
                kv_budget_mib: 16,
                ..EngineConfig::default()
            },
        )
        .expect("engine");
        let srv = TestServer::start_engine(&case, serve_cfg(), None, engine, tok);
        if let Some(f) = fixture {
            prompt_tokens_are_llama_cpps(&srv, f);
        }
        let stdout = run_client_script("tool_calls.py", &srv.url, &[]);
        eprintln!("{case}: {}", stdout.lines().last().unwrap_or_default());
        assert_eq!(srv.metric("custody_integrity_violations_total"), 0.0);
        let audit = srv.stop();
        let rows = read_table(&audit, "request_tools");
        let formats: Vec<String> = rows
            .iter()
            .flat_map(|b| col_str(b, "format"))
            .map(Option::unwrap_or_default)
            .collect();
        // The script's four offers (required, named, streamed named, auto; `none` offers
        // nothing), and the fixture's two turns.
        let offers = 4 + if fixture.is_some() { 2 } else { 0 };
        assert_eq!(formats.len(), offers, "{case}: {formats:?}");
        assert!(formats.iter().all(|f| f == format), "{case}: {formats:?}");
    }
}

/// Posts each turn of `tests/fixtures/tools/<fixture>.json` (arguments sent as the API sends
/// them, a JSON string) and checks `usage.prompt_tokens` against llama.cpp's ids.
fn prompt_tokens_are_llama_cpps(srv: &TestServer, fixture: &str) {
    let path = custody_tests::fixture(&format!("tools/{fixture}.json"));
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
    for turn in c["turns"].as_array().expect("turns") {
        let mut messages = turn["messages"].clone();
        for m in messages.as_array_mut().expect("messages") {
            for call in m["tool_calls"].as_array_mut().into_iter().flatten() {
                let args = call["function"]["arguments"].to_string();
                call["function"]["arguments"] = serde_json::Value::String(args);
            }
        }
        let body = serde_json::json!({
            "model": MODEL_ID, "messages": messages, "tools": c["tools"],
            "tool_choice": "auto", "max_tokens": 1, "temperature": 0,
        });
        let r = srv.post("/v1/chat/completions", KEY, body.to_string().as_bytes());
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(r.status, 200, "{fixture}: {v}");
        let want = turn["ids"].as_array().expect("ids").len() as u64;
        assert_eq!(v["usage"]["prompt_tokens"], want, "{fixture}: {v}");
    }
}

/// Copies the GGUF at `src` to `dst` with its `<arch>.context_length` (a u32, found once) set
/// to `n_ctx`: the same bytes otherwise, so the offsets of everything after it hold.
fn with_context_length(src: &std::path::Path, dst: &std::path::Path, n_ctx: u32) {
    const KEY: &[u8] = b".context_length";
    const GGUF_TYPE_U32: u32 = 4;
    let mut bytes = std::fs::read(src).expect("gguf");
    let hits: Vec<usize> = bytes
        .windows(KEY.len())
        .enumerate()
        .filter(|(_, w)| *w == KEY)
        .map(|(i, _)| i + KEY.len())
        .collect();
    assert_eq!(hits.len(), 1, "{}: one context_length key", src.display());
    let at = hits[0];
    let ty = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    assert_eq!(ty, GGUF_TYPE_U32, "context_length is a u32");
    bytes[at + 4..at + 8].copy_from_slice(&n_ctx.to_le_bytes());
    std::fs::write(dst, bytes).expect("write gguf");
}

fn run_client_script(script: &str, url: &str, env: &[(&str, &str)]) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    let out = Command::new(python_with_openai())
        .arg(&path)
        .envs(env.iter().copied())
        .env("CUSTODY_URL", url)
        .env("CUSTODY_KEY", KEY)
        .env("CUSTODY_MODEL_ID", MODEL_ID)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `custody forensics request`'s rows for request `id` of node `NODE`, one per line
/// (`what detail info`).
fn request_timeline(audit: &std::path::Path, id: u64) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("rt");
    rt.block_on(async {
        let vs = custody_query::session_over_verified(audit, None)
            .await
            .expect("session");
        custody_query::prepare_forensics(&vs.ctx)
            .await
            .expect("prepare");
        let batches = vs
            .ctx
            .sql(&custody_query::forensics::request_sql(NODE, id))
            .await
            .expect("request sql")
            .collect()
            .await
            .expect("rows");
        let mut out = String::new();
        for b in &batches {
            let s = |n: &str| {
                arrow::compute::cast(
                    b.column_by_name(n).expect(n),
                    &arrow::datatypes::DataType::Utf8,
                )
                .expect("cast")
            };
            let (w, d, i) = (s("what"), s("detail"), s("info"));
            let str_at = |a: &arrow::array::ArrayRef, r: usize| {
                let a = a
                    .as_any()
                    .downcast_ref::<arrow::array::StringArray>()
                    .expect("utf8");
                if arrow::array::Array::is_null(a, r) {
                    String::new()
                } else {
                    a.value(r).to_owned()
                }
            };
            for r in 0..b.num_rows() {
                out.push_str(&format!(
                    "{} {} {}\n",
                    str_at(&w, r),
                    str_at(&d, r),
                    str_at(&i, r)
                ));
            }
        }
        out
    })
}

/// The golden prompts' reference on a separate, idle engine (what `custody validate` does).
fn golden_reference() -> Vec<custody_server::Golden> {
    let mut e = engine_with(crate::small_cfg());
    let pool = custody_runtime::par::ThreadPool::new(2).expect("pool");
    custody_server::canary::reference(&mut e, &pool, &tokenizer(), "_validate").expect("reference")
}

/// SplitMix64: the fuzz cases are reproducible from the seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn fuzz_cases(rng: &mut Rng, n: usize) -> Vec<Vec<u8>> {
    let valid_chat =
        br#"{"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3, "temperature": 0}"#
            .to_vec();
    let valid_comp =
        br#"{"prompt": "Hello", "max_tokens": 3, "temperature": 0.5, "seed": 1}"#.to_vec();
    let fixed: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"null".to_vec(),
        b"{}".to_vec(),
        b"[]".to_vec(),
        b"\"string\"".to_vec(),
        br#"{"prompt": "x", "max_tokens": 1e309}"#.to_vec(),
        br#"{"prompt": "x", "max_tokens": 18446744073709551616}"#.to_vec(),
        br#"{"prompt": "x", "max_tokens": 18446744073709551615}"#.to_vec(),
        br#"{"prompt": "x", "max_tokens": -9223372036854775809}"#.to_vec(),
        br#"{"prompt": "x", "temperature": 1e308}"#.to_vec(),
        br#"{"prompt": "x", "top_p": -0.0}"#.to_vec(),
        br#"{"prompt": "x", "seed": 1e400}"#.to_vec(),
        br#"{"prompt": [4294967296]}"#.to_vec(),
        br#"{"prompt": [-1]}"#.to_vec(),
        br#"{"prompt": [[1, 2]]}"#.to_vec(),
        br#"{"prompt": ""}"#.to_vec(),
        br#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#.to_vec(),
        br#"{"messages": [{"role": "user", "content": "\ud800"}]}"#.to_vec(),
        b"{\"prompt\": \"\xc3\x28\"}".to_vec(),
        b"{\"prompt\": \"\xed\xa0\x80\"}".to_vec(),
        b"\xef\xbb\xbf{\"prompt\": \"bom\"}".to_vec(),
        format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        format!("{{\"prompt\": \"{}\"}}", "\\u0000".repeat(1000)).into_bytes(),
        br#"{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}"#.to_vec(),
        br#"{"prompt": "x", "stop": [""]}"#.to_vec(),
        br#"{"prompt": "x", "n": 99}"#.to_vec(),
        br#"{"prompt": "x", "stream": "yes"}"#.to_vec(),
        br#"{"prompt": "x", "prompt": 3}"#.to_vec(),
    ];
    let mut out = fixed;
    while out.len() < n {
        let base = if rng.below(2) == 0 {
            &valid_chat
        } else {
            &valid_comp
        };
        let case = match rng.below(4) {
            // Random bytes.
            0 => (0..rng.below(256)).map(|_| rng.next() as u8).collect(),
            // Truncated.
            1 => base[..rng.below(base.len())].to_vec(),
            // A byte replaced (often invalid UTF-8 or broken structure, sometimes still valid).
            2 => {
                let mut b = base.clone();
                let i = rng.below(b.len());
                b[i] = rng.next() as u8;
                b
            }
            // A number replaced by a huge or odd one.
            _ => {
                let nums = [
                    "1e999",
                    "-0",
                    "1.5",
                    "99999999999999999999999",
                    "NaN",
                    "Infinity",
                    "0x10",
                ];
                let s = String::from_utf8(base.clone()).expect("utf8");
                s.replacen('3', nums[rng.below(nums.len())], 1).into_bytes()
            }
        };
        out.push(case);
    }
    out
}

#[test]
fn fuzzed_bodies_always_get_a_json_error_and_never_a_crash() {
    let srv = TestServer::start("fuzz");
    let mut rng = Rng(0x5eed_f00d);
    let cases = fuzz_cases(&mut rng, 240);
    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    for (i, body) in cases.iter().enumerate() {
        let path = if i % 2 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let r = srv.post(path, KEY, body);
        *by_status.entry(r.status).or_default() += 1;
        let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
        assert!(
            r.status == 200 || (400..500).contains(&r.status),
            "case {i} {shown:?} on {path}: status {}",
            r.status
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_else(|e| {
            panic!(
                "case {i} {shown:?}: body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&r.body)
            )
        });
        if r.status == 200 {
            assert!(v["choices"].is_array(), "case {i}: {v}");
        } else {
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| !m.is_empty()),
                "case {i} {shown:?}: no error message: {v}"
            );
            assert!(
                r.header("x-request-id").is_some(),
                "case {i}: no request id"
            );
        }
    }
    // Mostly errors, as designed; and the server is still healthy and serving.
    let errors: usize = by_status
        .iter()
        .filter(|(s, _)| **s != 200)
        .map(|(_, n)| n)
        .sum();
    assert!(errors > cases.len() / 2, "{by_status:?}");
    assert_eq!(srv.get("/health").status, 200);
    let ok = srv.post(
        "/v1/completions",
        KEY,
        br#"{"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}"#,
    );
    assert_eq!(ok.status, 200, "{}", String::from_utf8_lossy(&ok.body));
    // Every page comes back (polled: the gauge follows the engine's step, and a canary run may
    // be holding pages right now).
    let t0 = Instant::now();
    while srv.metric("custody_kv_pages_used") != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "pages still allocated after the fuzz run"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    srv.stop();
}

#[test]
fn shutdown_drains_a_live_stream_then_seals_the_audit_log() {
    // With an absurd yardstick (a prompt of 8+ tokens "should" take hours) every request is a
    // prefill anomaly: this checks that the flag reaches the metric and the audit log.
    let srv = TestServer::start_with(
        "drain",
        ServeSection {
            prefill_anomaly_factor: 1e-9,
            prefill_anomaly_min_tokens: 8,
            ..serve_cfg()
        },
    );
    let url = srv.url.clone();
    let stream = std::thread::spawn(move || {
        client::request(
            &url,
            "POST",
            "/v1/completions",
            Some(KEY),
            Some(br#"{"prompt": "Count to one hundred: 1, 2, 3,", "max_tokens": 48, "temperature": 0, "stream": true}"#),
            Duration::from_secs(300),
        )
        .expect("stream")
    });
    let t0 = Instant::now();
    while srv.metric("custody_running_requests") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the stream never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let url = srv.url.clone();
    assert!(srv.metric("custody_prefill_anomalies_total") >= 1.0);
    let audit = srv.stop();
    let r = stream.join().expect("stream thread");
    let body = String::from_utf8_lossy(&r.body);
    assert_eq!(r.status, 200);
    assert!(
        body.contains("\"finish_reason\":\"length\"") && body.trim_end().ends_with("data: [DONE]"),
        "the in-flight stream was cut instead of drained: {body}"
    );
    // Nothing listens any more.
    assert!(client::request(&url, "GET", "/health", None, None, Duration::from_secs(5)).is_err());
    let id = engine_id(r.header("x-request-id").expect("request id"));
    let reqs = requests(&audit);
    assert_eq!(reqs[&id].1, ["admitted", "finished"], "{reqs:?}");
    let anomalies: Vec<String> = node_events(&audit, "prefill_anomaly");
    assert!(
        anomalies
            .iter()
            .any(|d| d.contains(&format!("\"request\":{id},")) && d.contains("\"tenant\":\"acme\"")),
        "no prefill_anomaly event for request {id}: {anomalies:?}"
    );
}

#[test]
fn fronting_a_disaggregated_pair_serves_the_colocated_output_token_for_token() {
    use custody_audit::{Event as AEvent, RequestKind};
    let nodes = crate::disagg::start_pair_decoding(crate::small_cfg(), crate::small_cfg());
    let pool = custody_runtime::par::ThreadPool::new(2).expect("pool");
    // An absurd prefill yardstick: every prompt of 8+ tokens is "too fast", which checks that
    // the flag is wired in front of a pair too.
    let cfg = ServeSection {
        prefill_anomaly_factor: 1e-9,
        prefill_anomaly_min_tokens: 8,
        ..serve_cfg()
    };
    let prepared =
        custody_server::prepare_front(engine_with(crate::small_cfg()), pool, tokenizer(), &cfg)
            .expect("prepare");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let metrics_listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let metrics_url = format!("http://{}", metrics_listener.local_addr().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let prefill = format!("http://{}", nodes.pair.prefill_addr);
    // The front's own log (node events: prefill anomalies, canary results).
    let front_log = Arc::new(custody_audit::MemorySink::default());
    let opts = ServeOptions {
        metrics: Some(metrics_listener),
        cfg,
        node: 0,
        audit: None,
        events: Some(front_log.clone() as Arc<dyn custody_audit::AuditSink>),
        prefix_cache: Default::default(),
        unsafe_shared_prefix_cache: false,
        kv_offload: None,
        audit_disabled: false,
        proofs: None,
    };
    // This server is the pair's front 0, with a certificate from the suite's fleet.
    let front = custody_runtime::disagg::tls::Security::Tls(
        crate::disagg::fleet()
            .node_tls(
                custody_runtime::disagg::client::PAIR_FRONT,
                vec![custody_runtime::disagg::tls::NodeIdentity::new(
                    custody_runtime::disagg::tls::Role::Prefill,
                    1,
                )],
            )
            .expect("front certificate"),
    );
    let done = rt.spawn(async move {
        custody_server::serve_prefill(listener, prepared, &prefill, &front, opts, async move {
            let _ = stopped.await;
        })
        .await
    });
    let t0 = Instant::now();
    while client::request(&url, "GET", "/health", None, None, Duration::from_secs(5))
        .map_or(true, |r| r.status != 200)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "front did not come up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // The pair's greedy output through HTTP equals the colocated reference, token for token.
    let report = client::validate(&url, KEY, &golden_reference()).expect("validate");
    assert!(report.pass(), "{report:?}");

    // Decoding options travel with the request: structured outputs (prefill samples the first
    // token under the constraint, decode the rest), log-probabilities, biases, tool calls —
    // through the official client, as against a colocated server.
    // n > 1 through the pair: three choices in index order, the same three when asked again.
    let three = || {
        let r = client::request(
            &url,
            "POST",
            "/v1/completions",
            Some(KEY),
            Some(br#"{"prompt": "The lighthouse keeper", "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 3}"#),
            Duration::from_secs(120),
        )
        .expect("n = 3");
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        let cs = v["choices"].as_array().expect("choices").clone();
        assert_eq!(cs.len(), 3, "{v}");
        cs.iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"].as_u64(), Some(i as u64));
                c["text"].as_str().expect("text").to_owned()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        three(),
        three(),
        "n = 3 with a seed is reproducible through the pair"
    );
    // (Eight of the schema corpus: the whole corpus is the colocated test's.)
    for script in ["structured_outputs.py", "tool_calls.py"] {
        let out = run_client_script(script, &url, &[("CUSTODY_SCHEMAS", "8")]);
        eprintln!("pair, {script}: {}", out.lines().last().unwrap_or_default());
    }

    // A streamed chat request; its id names the prefill node's audit record, with the tenant.
    let r = client::request(
        &url,
        "POST",
        "/v1/chat/completions",
        Some(KEY),
        Some(br#"{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0, "stream": true}"#),
        Duration::from_secs(120),
    )
    .expect("chat");
    let body = String::from_utf8_lossy(&r.body);
    assert_eq!(r.status, 200, "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let rid = r.header("x-request-id").expect("request id");
    let id: u64 = rid
        .strip_prefix("req-1-")
        .unwrap_or_else(|| panic!("{rid}: not the prefill node's (node 1) id"))
        .parse()
        .expect("id");
    let recorded = nodes
        .prefill_audit
        .events
        .lock()
        .expect("events")
        .iter()
        .any(|e| matches!(e, AEvent::Request { request, tenant, kind: RequestKind::Admitted, .. } if *request == id && &**tenant == "acme"));
    assert!(
        recorded,
        "request {id} of tenant acme is not in the prefill node's audit log"
    );
    let metrics = client::request(
        &metrics_url,
        "GET",
        "/metrics",
        None,
        None,
        Duration::from_secs(30),
    )
    .expect("metrics");
    let metrics = String::from_utf8_lossy(&metrics.body).into_owned();
    let anomalies: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("custody_prefill_anomalies_total ")?
                .parse()
                .ok()
        })
        .expect("anomaly counter");
    assert!(anomalies >= 1.0, "{metrics}");
    // …and in the front's own audit log, naming the request.
    let anomaly_events = front_log
        .events
        .lock()
        .expect("events")
        .iter()
        .filter(|e| matches!(e, AEvent::Node { kind, .. } if &**kind == "prefill_anomaly"))
        .count();
    assert!(
        anomaly_events >= 1,
        "no prefill_anomaly node event in the front's audit log"
    );

    // How requests end, as decode records them: a length finish, and a stop sequence the
    // server matched in the text — `finished`, its reason, the tokens in the client's `usage`
    // (the front tells the pair, `Prefill.End`; not `aborted` as a dropped stream would be).
    let post = |body: &str| {
        client::request(
            &url,
            "POST",
            "/v1/completions",
            Some(KEY),
            Some(body.as_bytes()),
            Duration::from_secs(120),
        )
        .expect("completion")
    };
    let completion = |body: String| {
        let r = post(&body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        serde_json::from_slice::<serde_json::Value>(&r.body).expect("json")
    };
    // Decode's `requests` rows: (request, kind, output tokens).
    let decode_rows = || -> Vec<(u64, RequestKind, u32)> {
        let events = nodes.decode_audit.events.lock().expect("events");
        events
            .iter()
            .filter_map(|e| match e {
                AEvent::Request {
                    request,
                    kind,
                    output_tokens,
                    ..
                } => Some((*request, kind.clone(), *output_tokens)),
                _ => None,
            })
            .collect()
    };
    let newest_decode_request = || decode_rows().iter().map(|r| r.0).max().unwrap_or(0);
    // The newest request's end after `after`, once recorded.
    let decode_end = |after: u64| {
        let t0 = Instant::now();
        loop {
            let end = decode_rows()
                .into_iter()
                .filter(|r| r.0 > after && r.1 != RequestKind::Admitted)
                .max_by_key(|r| r.0);
            if let Some(e) = end {
                return e;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "no end on decode");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let prompt = "Count to one hundred: 1, 2, 3,";
    let before = newest_decode_request();
    let v = completion(format!(
        r#"{{"prompt": "{prompt}", "max_tokens": 12, "temperature": 0}}"#
    ));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let (_, kind, out) = decode_end(before);
    assert_eq!(
        (kind, out),
        (
            RequestKind::Finished {
                reason: "length".into()
            },
            12
        ),
        "{v}"
    );
    let text = v["choices"][0]["text"].as_str().expect("text").to_owned();
    let stop_text: String = text[text.len() / 2..].chars().take(2).collect();
    // The stop is matched on the front and told to decode, which keeps generating until the
    // message lands: with `max_tokens` 12 decode could reach its own length finish first (it
    // then records `length`, 12 — what it did; seen once on a loaded CI machine). 200 leaves
    // the message ~190 decode steps to arrive; greedy, the first 12 tokens are the ones above.
    let before = newest_decode_request();
    let v = completion(format!(
        r#"{{"prompt": "{prompt}", "max_tokens": 200, "temperature": 0, "stop": [{stop_text:?}]}}"#
    ));
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let usage = v["usage"]["completion_tokens"].as_u64().expect("usage") as u32;
    assert!((1..12).contains(&usage), "{v}");
    let (_, kind, out) = decode_end(before);
    assert_eq!(
        (kind, out),
        (
            RequestKind::Finished {
                reason: "stop".into()
            },
            usage
        ),
        "decode records the end the client saw: {v}"
    );

    // Over-length: 400 from the pair's admission, with its reason.
    let long = format!(
        "{{\"prompt\": \"{}\", \"max_tokens\": 8}}",
        "hello ".repeat(CONTEXT + 50)
    );
    let r = post(&long);
    let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(r.status, 400, "{v}");
    let msg = v["error"]["message"].as_str().expect("message");
    assert!(msg.contains("exceeds the context length"), "{msg}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");

    let _ = stop.send(());
    rt.block_on(done)
        .expect("task")
        .expect("front stopped cleanly");
    // Nothing is left behind on the pair.
    let t0 = Instant::now();
    while nodes
        .pair
        .prefill
        .stats_blocking()
        .is_none_or(|s| s.live_requests != 0)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "prefill still holds requests"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An audit queue that is always full.
#[derive(Debug)]
struct FullQueue;

impl AuditStats for FullQueue {
    fn queue_depth(&self) -> u64 {
        1000
    }
    fn queue_capacity(&self) -> u64 {
        1000
    }
    fn dropped_total(&self) -> u64 {
        0
    }
}

#[test]
fn an_audit_log_that_cannot_keep_up_is_503_and_a_drain_that_times_out_aborts() {
    // Audit back-pressure: refused with 503 and OpenAI's error body, before anything is admitted.
    let srv = TestServer::start_full("backpressure", serve_cfg(), Some(Arc::new(FullQueue)));
    let r = srv.post(
        "/v1/completions",
        KEY,
        br#"{"prompt": "Hello", "max_tokens": 4}"#,
    );
    let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    assert_eq!(r.status, 503, "{v}");
    assert_eq!(v["error"]["code"], "audit_backpressure");
    assert!(r.header("retry-after").is_some());
    assert_eq!(
        srv.metric("custody_audit_backpressure_rejections_total"),
        1.0
    );
    assert_eq!(srv.metric("custody_audit_queue_depth"), 1000.0);
    srv.stop();

    // A drain is bounded: a stream that would outlive `drain_timeout_s` is aborted (an error
    // event, no silent cut), its pages released, and the log sealed and verified all the same.
    let srv = TestServer::start_with(
        "drain-timeout",
        ServeSection {
            drain_timeout_s: 1,
            ..serve_cfg()
        },
    );
    let url = srv.url.clone();
    let stream = std::thread::spawn(move || {
        client::request(
            &url,
            "POST",
            "/v1/completions",
            Some(KEY),
            Some(br#"{"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": true}"#),
            Duration::from_secs(300),
        )
        .expect("stream")
    });
    let t0 = Instant::now();
    while srv.metric("custody_running_requests") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the stream never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t1 = Instant::now();
    let audit = srv.stop();
    assert!(
        t1.elapsed() < Duration::from_secs(30),
        "shutdown took {:?}",
        t1.elapsed()
    );
    let r = stream.join().expect("stream thread");
    let body = String::from_utf8_lossy(&r.body);
    assert!(
        body.contains("drain timeout") && body.contains("\"error\""),
        "the stream must end with an error event: {body}"
    );
    assert!(
        !body.contains("[DONE]"),
        "an aborted stream must not look complete: {body}"
    );
    let id = engine_id(r.header("x-request-id").expect("request id"));
    assert_eq!(requests(&audit)[&id].1, ["admitted", "aborted"]);
}

/// The terminal `requests` row of each request: (event, reason, output_tokens).
fn ends(audit: &std::path::Path) -> BTreeMap<u64, (String, Option<String>, u32)> {
    let mut out = BTreeMap::new();
    for b in read_table(audit, "requests") {
        let (ids, events, reasons, outputs) = (
            col_u64(&b, "request_id"),
            col_str(&b, "event"),
            col_str(&b, "reason"),
            col_u32(&b, "output_tokens"),
        );
        for i in 0..ids.len() {
            let ev = events[i].clone().unwrap_or_default();
            if ev != "admitted" {
                out.insert(ids[i], (ev, reasons[i].clone(), outputs[i].unwrap_or(0)));
            }
        }
    }
    out
}

/// Every way a request ends is recorded as its client saw it: the `requests` row's event and
/// reason are the response's finish (or why it was cut), and `output_tokens` is its `usage` —
/// a stop sequence the server matched in the text is `finished`/`stop` with the tokens the
/// client got (not `aborted` with however many the engine had computed by then).
#[test]
fn every_end_is_recorded_as_the_client_saw_it() {
    let srv = TestServer::start("ends");
    let completion = |body: &str| {
        let r = srv.post("/v1/completions", KEY, body.as_bytes());
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        let id = engine_id(r.header("x-request-id").expect("request id"));
        (id, v)
    };
    let prompt = "Count to one hundred: 1, 2, 3,";
    // Length.
    let (len_id, v) = completion(&format!(
        r#"{{"prompt": "{prompt}", "max_tokens": 12, "temperature": 0}}"#
    ));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let text = v["choices"][0]["text"].as_str().expect("text").to_owned();
    // A stop sequence from the middle of that (greedy, so the same) text.
    let half = text.len() / 2;
    let stop: String = text[half..].chars().take(2).collect();
    assert!(
        text.find(&stop).is_some_and(|i| i > 0),
        "{text:?} / {stop:?}"
    );
    // max_tokens 200: the engine keeps stepping until the server's end reaches it, and with 12
    // it could reach its own length finish first (see the fronted-pair test).
    let (stop_id, v) = completion(&format!(
        r#"{{"prompt": "{prompt}", "max_tokens": 200, "temperature": 0, "stop": [{stop:?}]}}"#
    ));
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let stop_usage = v["usage"]["completion_tokens"].as_u64().expect("usage") as u32;
    assert!((1..12).contains(&stop_usage), "{v}");
    // A client that goes away mid-stream.
    let gone_id = {
        use std::io::{BufRead, BufReader, Write};
        let host = srv.url.trim_start_matches("http://").to_owned();
        let mut sock = std::net::TcpStream::connect(&host).expect("connect");
        let body = format!(
            r#"{{"prompt": "{prompt}", "max_tokens": 400, "temperature": 0, "stream": true}}"#
        );
        write!(
            sock,
            "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        let mut lines = BufReader::new(sock.try_clone().expect("clone"));
        let (mut id, mut line) = (None, String::new());
        while lines.read_line(&mut line).expect("read") > 0 {
            if let Some(v) = line.trim().strip_prefix("x-request-id: ") {
                id = Some(engine_id(v));
            }
            if line.starts_with("data: ") {
                break; // the first chunk arrived: now go away
            }
            line.clear();
        }
        drop(lines);
        drop(sock);
        id.expect("x-request-id header")
    };
    let t0 = Instant::now();
    while srv.metric("custody_running_requests") > 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the abandoned stream kept running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let audit = srv.stop();
    let ends = ends(&audit);
    assert_eq!(
        ends[&len_id],
        ("finished".into(), Some("length".into()), 12)
    );
    assert_eq!(
        ends[&stop_id],
        ("finished".into(), Some("stop".into()), stop_usage),
        "the log must say what the client got"
    );
    let (ev, reason, out) = &ends[&gone_id];
    assert_eq!(
        (ev.as_str(), reason.as_deref()),
        ("aborted", Some("client_disconnected"))
    );
    assert!(
        (1..400).contains(out),
        "{out} tokens handed to the client before it left"
    );
}

/// The server on each architecture's tiny model (`tests/fixtures/arch`, see `arch_models`): a
/// chat through `/v1/chat/completions` renders the GGUF's own template and tokenizes it as
/// llama.cpp does — `usage.prompt_tokens` is llama.cpp's count for the rendered chat — and
/// answers, audited, as on the embedded model.
#[test]
fn chat_completions_run_every_architecture_end_to_end() {
    for model in ["llama-spm", "llama3", "qwen2", "qwen3"] {
        let chat: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(custody_tests::fixture(&format!("arch/{model}.chat.json")))
                .expect("fixture"),
        )
        .expect("json");
        let file = chat["file"].as_str().expect("file");
        let srv = TestServer::start_model(model, &custody_tests::fixture(&format!("arch/{file}")));
        let body = serde_json::json!({
            "model": MODEL_ID,
            "messages": chat["messages"],
            "max_tokens": 4,
            "temperature": 0,
        });
        let r = srv.post("/v1/chat/completions", KEY, body.to_string().as_bytes());
        assert_eq!(
            r.status,
            200,
            "{model}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        let want = chat["ids"].as_array().expect("ids").len() as u64;
        assert_eq!(v["usage"]["prompt_tokens"], want, "{model}: {v}");
        assert!(
            v["usage"]["completion_tokens"]
                .as_u64()
                .is_some_and(|n| (1..=4).contains(&n))
        );
        let id = engine_id(r.header("x-request-id").expect("request id"));
        let audit = srv.stop();
        let reqs = requests(&audit);
        assert_eq!(reqs[&id].0, "acme", "{model}");
        assert_eq!(reqs[&id].1, ["admitted", "finished"], "{model}");
        eprintln!("{model}: {want} prompt tokens, answered and audited");
    }
}

pub(crate) const KEY_BRAVO: &str = "sk-test-bravo";

pub(crate) fn cache_cfg() -> ServeSection {
    let mut cfg = serve_cfg();
    cfg.canary_interval_s = 0;
    cfg.tenants.push(TenantSection {
        id: "bravo".into(),
        keys_sha256: vec![hash_key(KEY_BRAVO)],
        max_concurrent: 8,
        tokens_per_minute: 0,
    });
    cfg
}

/// `[prefix_cache]` with one public scope of raw `text`, if any.
pub(crate) fn public_scope(text: Option<&str>) -> PrefixCacheSection {
    PrefixCacheSection {
        secret_file: None,
        public: text
            .map(|t| {
                vec![PublicScopeSection {
                    scope: "helpdesk".into(),
                    text: Some(t.into()),
                    system_prompt: None,
                }]
            })
            .unwrap_or_default(),
    }
}

/// One greedy completion of one token: (request id, `usage.prompt_tokens_details.cached_tokens`).
pub(crate) fn complete(
    srv: &TestServer,
    key: &str,
    prompt: serde_json::Value,
    salt: Option<&str>,
) -> (String, usize) {
    let mut body = serde_json::json!({
        "model": MODEL_ID, "prompt": prompt, "max_tokens": 1, "temperature": 0,
    });
    if let Some(s) = salt {
        body["cache_salt"] = s.into();
    }
    let r = srv.post("/v1/completions", key, body.to_string().as_bytes());
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens in usage") as usize;
    (v["id"].as_str().expect("id").to_owned(), cached)
}

pub(crate) fn cmpl_engine_id(id: &str) -> u64 {
    engine_id(id.strip_prefix("cmpl-").expect("a completion id"))
}

/// The exposure rows and the cache question's rows over a sealed root.
pub(crate) fn forensics(
    audit: &std::path::Path,
) -> (
    custody_query::forensics::Exposure,
    Vec<(String, String, String, bool)>,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("rt");
    rt.block_on(async {
        let vs = custody_query::session_over_verified(audit, None)
            .await
            .expect("session");
        assert!(vs.report.problems.is_empty(), "{:?}", vs.report.problems);
        custody_query::prepare_forensics(&vs.ctx)
            .await
            .expect("prepare");
        let e = custody_query::forensics::exposure(&vs.ctx, None, None)
            .await
            .expect("exposure");
        let batches = vs
            .ctx
            .sql(custody_query::forensics::CACHE_SQL)
            .await
            .expect("cache sql")
            .collect()
            .await
            .expect("cache rows");
        let mut rows = Vec::new();
        for b in &batches {
            let s = |n: &str| {
                arrow::compute::cast(
                    b.column_by_name(n).expect(n),
                    &arrow::datatypes::DataType::Utf8,
                )
                .expect("cast")
            };
            let (r, w, k, x) = (
                s("reader_tenant"),
                s("writer_tenant"),
                s("scope_kind"),
                s("cross_tenant"),
            );
            use arrow::array::AsArray;
            for i in 0..b.num_rows() {
                rows.push((
                    r.as_string::<i32>().value(i).to_owned(),
                    w.as_string::<i32>().value(i).to_owned(),
                    k.as_string::<i32>().value(i).to_owned(),
                    x.as_string::<i32>().value(i) == "true",
                ));
            }
        }
        (e, rows)
    })
}

/// The paired isolation test: same tenant → hit; another tenant, same prompt → miss; another
/// tenant with the victim's `cache_salt` → miss; a public scope → a hit for both, recorded as
/// such — and none of it an exposure in the forensic answer.
#[test]
fn prefix_cache_isolation_is_paired_and_public_scopes_are_recorded() {
    use crate::prefix_cache::text;
    let tok = tokenizer();
    let sys = text(7, 70);
    let srv = TestServer::start_cache(
        "cache-isolation",
        cache_cfg(),
        public_scope(Some(&sys)),
        false,
    );
    let p = serde_json::Value::from(text(8, 100));
    let n = tok.encode(&text(8, 100), false).expect("tokenize").len();
    let full = (n - 1) / 16 * 16;

    assert_eq!(
        complete(&srv, KEY, p.clone(), None).1,
        0,
        "first sight: a miss"
    );
    assert_eq!(
        complete(&srv, KEY, p.clone(), None).1,
        full,
        "same tenant: a hit"
    );
    assert_eq!(
        complete(&srv, KEY_BRAVO, p.clone(), None).1,
        0,
        "another tenant: a miss"
    );
    assert_eq!(
        complete(&srv, KEY, p.clone(), Some("victim-salt")).1,
        0,
        "a salt narrows"
    );
    assert_eq!(complete(&srv, KEY, p.clone(), Some("victim-salt")).1, full);
    assert_eq!(
        complete(&srv, KEY_BRAVO, p.clone(), Some("victim-salt")).1,
        0,
        "the victim's salt does not widen another tenant's namespace"
    );
    // The public scope: both tenants share the declared prefix's pages.
    let sys_n = tok.encode(&sys, false).expect("tokenize").len();
    let ask = |q| serde_json::Value::from(format!("{sys} {}", text(q, 30)));
    let (_, a1) = complete(&srv, KEY, ask(9), None);
    let (b_id, b1) = complete(&srv, KEY_BRAVO, ask(10), None);
    assert_eq!(a1, 0);
    assert!(
        b1 > 0 && b1 <= sys_n / 16 * 16,
        "bravo hits the public pages acme computed: {b1}"
    );
    assert!(srv.metric("custody_prefix_cache_hit_rate{tenant=\"acme\"}") > 0.0);
    assert!(srv.metric("custody_prefix_cache_hit_rate{tenant=\"bravo\"}") > 0.0);
    assert!(srv.metric("custody_prefix_cache_pages") > 0.0);

    let audit = srv.stop();
    let (exposure, cache) = forensics(&audit);
    assert_eq!(exposure.affected_responses(), 0, "{:?}", exposure.affected);
    assert!(
        cache
            .iter()
            .any(|(r, w, k, x)| r == "bravo" && w == "acme" && k == "public" && *x)
    );
    assert!(
        cache.iter().all(|(_, _, k, x)| !x || k == "public"),
        "only a public scope crosses tenants: {cache:?}"
    );
    let _ = b_id;
    // The public scope is on the record, with its namespace.
    let scopes: Vec<String> = node_events(&audit, "prefix_scope");
    assert_eq!(scopes.len(), 1, "{scopes:?}");
    assert!(
        scopes[0].starts_with("scope=public:helpdesk tokens="),
        "{scopes:?}"
    );
}

/// The incident, for prefix caches: `[unsafe_reproduction] shared_prefix_cache` keys the cache
/// without the tenant, so another tenant's prompt prefix is a hit (the client even sees it in
/// `cached_tokens`). The forensic answer names every cross-tenant hit exactly: per attacker
/// request, the slots of the victim's pages it attended — here computed from the prompts alone
/// (the longest common prefix with an earlier victim prompt, in whole pages, short of the last
/// token), independently of the engine and the log.
#[test]
fn unsafe_shared_prefix_cache_leaks_and_the_forensics_name_every_cross_tenant_hit() {
    use crate::prefix_cache::text;
    let tok = tokenizer();
    let srv = TestServer::start_cache("cache-unsafe", cache_cfg(), public_scope(None), true);
    let victim: Vec<Vec<u32>> = (0..3)
        .map(|k| tok.encode(&text(30 + k, 90), false).expect("tokenize"))
        .collect();
    for v in &victim {
        complete(&srv, KEY, serde_json::json!(v), None);
    }
    // acme again: a same-tenant hit, not an exposure.
    complete(&srv, KEY, serde_json::json!(victim[0]), None);
    let expected = attack_with_cuts_of(&srv, &victim, 50);
    let audit = srv.stop();
    let cache = exposure_names_exactly(&audit, &expected);
    assert!(
        cache
            .iter()
            .any(|(r, w, k, x)| r == "bravo" && w == "acme" && k == "unsafe" && *x)
    );
    let switches: Vec<String> = node_events(&audit, "prefix_scope");
    assert!(
        switches.iter().any(|d| d.contains("unsafe:global")),
        "{switches:?}"
    );
}

/// bravo's four prompts that start like acme's `victim` prompts (cut at 20, 55, 80 and 5 tokens,
/// then words of `seed0 + cut`), each asserted to be served `cached_tokens` exactly the longest
/// common prefix with a victim prompt, in whole pages short of the last token (an oracle from
/// the prompts alone). Returns the engine request id → foreign slots of the three that hit.
pub(crate) fn attack_with_cuts_of(
    srv: &TestServer,
    victim: &[Vec<u32>],
    seed0: usize,
) -> BTreeMap<u64, u64> {
    use crate::prefix_cache::text;
    let tok = tokenizer();
    let mut expected = BTreeMap::new();
    for (k, cut) in [(0usize, 20usize), (1, 55), (2, 80), (0, 5)] {
        let mut p = victim[k][..cut].to_vec();
        p.extend(
            tok.encode(&format!(" {}", text(seed0 + cut, 25)), false)
                .expect("tokenize"),
        );
        let common = victim
            .iter()
            .map(|v| v.iter().zip(&p).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0);
        let want = common.min(p.len() - 1) / 16 * 16;
        let (id, cached) = complete(srv, KEY_BRAVO, serde_json::json!(p), None);
        assert_eq!(cached, want, "bravo's cut {cut} of victim prompt {k}");
        if want > 0 {
            expected.insert(cmpl_engine_id(&id), want as u64);
        }
    }
    assert_eq!(expected.len(), 3, "three of the four attacker prompts hit");
    expected
}

/// The exposure question over a sealed root names exactly `expected` (bravo's request → slots
/// of acme's data), by DataFusion and by DuckDB reading the digest-named Parquet files itself
/// with the same SQL. Returns the cache question's rows.
pub(crate) fn exposure_names_exactly(
    audit: &std::path::Path,
    expected: &BTreeMap<u64, u64>,
) -> Vec<(String, String, String, bool)> {
    let (exposure, cache) = forensics(audit);
    let got: BTreeMap<u64, u64> = exposure
        .affected
        .iter()
        .map(|a| {
            assert_eq!(a.recipient_tenant, "bravo");
            assert_eq!(a.sources, vec![("acme".to_owned(), a.foreign_slots)]);
            (a.request, a.foreign_slots)
        })
        .collect();
    assert_eq!(&got, expected, "every cross-tenant read, exactly");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/duckdb-exposure.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(audit)
        .output()
        .expect("python3 (scripts/setup.sh installs duckdb)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let duck: BTreeMap<u64, u64> = text
        .lines()
        .skip_while(|l| !l.starts_with("node_id,"))
        .skip(1)
        .take_while(|l| !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[1].parse().expect("request"), f[4].parse().expect("slots"))
        })
        .collect();
    assert_eq!(&duck, expected, "DuckDB agrees");
    cache
}

/// Two-sample Kolmogorov–Smirnov: the statistic D and its asymptotic p-value (the Kolmogorov
/// distribution with Stephens' small-sample correction, as Numerical Recipes' `kstwo`).
pub(crate) fn ks_two_sample(a: &[f64], b: &[f64]) -> (f64, f64) {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let (n, m) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut d) = (0usize, 0usize, 0f64);
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / n - j as f64 / m).abs());
    }
    let en = (n * m / (n + m)).sqrt();
    let lambda = (en + 0.12 + 0.11 / en) * d;
    let mut p = 0.0;
    for k in 1..=100 {
        let k = k as f64;
        p += 2.0 * (-1f64).powf(k - 1.0) * (-2.0 * k * k * lambda * lambda).exp();
    }
    (d, p.clamp(0.0, 1.0))
}

#[test]
fn ks_two_sample_detects_a_shift_and_not_noise() {
    let a: Vec<f64> = (0..40).map(|i| (i * 37 % 40) as f64).collect();
    let same: Vec<f64> = (0..40).map(|i| (i * 13 % 40) as f64 + 0.5).collect();
    let shifted: Vec<f64> = a.iter().map(|x| x + 30.0).collect();
    assert!(ks_two_sample(&a, &same).1 > 0.5);
    assert!(ks_two_sample(&a, &shifted).1 < 1e-6);
}

/// The timing audit of Gu et al. (ICML 2025), against this server: an attacker (bravo) times
/// its own requests for prompts a victim (acme) just sent ("primed") and for fresh prompts of
/// the same length, interleaved; a two-sample KS test over the latencies finds no difference.
/// The same test for the victim's own tenant (whose prompts *are* cached) finds it at once —
/// proof the test can fail. Latency: one token, non-streaming, measured by the client (what an
/// attacker sees); `N_PER_GROUP` requests per distribution.
#[test]
fn timing_audit_finds_no_cross_tenant_cache_signal_and_finds_the_same_tenant_one() {
    use crate::prefix_cache::text;
    const N_PER_GROUP: usize = 30;
    const PROMPT_TOKENS: usize = 192;
    let tok = tokenizer();
    let srv = TestServer::start_cache("cache-timing", cache_cfg(), public_scope(None), false);
    let prompt = |seed: usize| {
        let mut t = tok.encode(&text(seed, 260), false).expect("tokenize");
        assert!(t.len() >= PROMPT_TOKENS);
        t.truncate(PROMPT_TOKENS);
        serde_json::json!(t)
    };
    let timed = |key: &str, p: serde_json::Value| {
        let t0 = Instant::now();
        let (_, cached) = complete(&srv, key, p, None);
        (t0.elapsed().as_secs_f64() * 1e3, cached)
    };
    // Warm up (first requests pay one-time costs).
    for s in 0..3 {
        timed(KEY_BRAVO, prompt(9000 + s));
    }
    let audit = |tenant: &str, prober: &str, seed0: usize| {
        let (mut primed, mut fresh, mut hits) = (Vec::new(), Vec::new(), 0);
        for i in 0..N_PER_GROUP {
            let (p, f) = (prompt(seed0 + 2 * i), prompt(seed0 + 2 * i + 1));
            complete(&srv, KEY, p.clone(), None); // the victim's request
            // Alternate which goes first, so drift in the machine's load hits both alike.
            let order = if i % 2 == 0 {
                [(true, p), (false, f)]
            } else {
                [(false, f), (true, p)]
            };
            for (is_primed, q) in order {
                let (ms, cached) = timed(prober, q);
                hits += usize::from(cached > 0);
                if is_primed {
                    primed.push(ms)
                } else {
                    fresh.push(ms)
                }
            }
        }
        let (d, p) = ks_two_sample(&primed, &fresh);
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        eprintln!(
            "timing audit, prober {tenant}: n = {N_PER_GROUP} + {N_PER_GROUP}, median primed {:.1} ms, fresh {:.1} ms, KS D = {d:.3}, p = {p:.3e}, hits {hits}",
            med(&mut primed.clone()),
            med(&mut fresh.clone())
        );
        (p, hits)
    };
    let (p_other, hits_other) = audit("bravo", KEY_BRAVO, 10_000);
    let (p_same, hits_same) = audit("acme", KEY, 20_000);
    assert_eq!(hits_other, 0, "no cross-tenant hit");
    assert_eq!(
        hits_same, N_PER_GROUP,
        "every primed prompt of the victim's own tenant hit"
    );
    assert!(
        p_same < 1e-6,
        "the test detects a cache hit's timing (p = {p_same:.3e})"
    );
    // Under no difference p is uniform: a false alarm at this level is 1 run in 1,000.
    assert!(
        p_other > 1e-3,
        "a cross-tenant timing signal (p = {p_other:.3e})"
    );
    srv.stop();
}

/// `/metrics` names every tenant with its request and token counts and prefix-cache hits: the
/// operator's, on a listener of its own. On the tenants' port no endpoint — asked with another
/// tenant's key or with none, by GET or POST — answers anything of acme's, nor any metric.
#[test]
fn no_endpoint_on_the_api_port_tells_one_tenant_of_another() {
    let srv = TestServer::start("side-channel");
    let r = srv.post(
        "/v1/completions",
        KEY,
        format!(
            r#"{{"model": "{MODEL_ID}", "prompt": "Hello", "max_tokens": 2, "temperature": 0}}"#
        )
        .as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let paths = [
        "/metrics",
        "/metrics/",
        "/v1/metrics",
        "/health",
        "/health/ready",
        "/health/live",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/",
    ];
    for path in paths {
        for key in [Some(KEY_TINY), None] {
            for method in ["GET", "POST"] {
                let r = client::request(
                    &srv.url,
                    method,
                    path,
                    key,
                    (method == "POST").then_some(&b"{}"[..]),
                    Duration::from_secs(30),
                )
                .expect(path);
                let body = String::from_utf8_lossy(&r.body);
                for leak in ["acme", "custody_", "tenant="] {
                    assert!(
                        !body.contains(leak),
                        "{method} {path} with key {key:?} ({}) tells of {leak:?}: {body}",
                        r.status
                    );
                }
            }
        }
    }
    // The operator still sees everything, on its own listener.
    assert!(
        srv.metric(
            "custody_requests_total{tenant=\"acme\",endpoint=\"completions\",status=\"200\"}"
        ) >= 1.0
    );
    srv.stop();
}

/// `n = 4` with a seed: four choices, the same four when asked again, choice 0 equal to the
/// `n = 1` answer with that seed, the streamed choices equal to the whole ones. The prompt is
/// computed once: choice 0 writes and shares its full pages, choices 1–3 are prefix-cache hits
/// on them (`prefix_cache` rows naming choice 0 as the writer), and the forensics find 0
/// exposures. `n` over `serve.max_n` (8) and `n = 0` are 400s naming `n`.
#[test]
fn n_choices_share_one_prompt_computation_and_are_reproducible() {
    use std::collections::BTreeMap;
    let srv = TestServer::start_cache("n-choices", cache_cfg(), public_scope(None), false);
    let prompt = crate::prefix_cache::text(11, 100);
    let body = |n: usize, stream: bool| {
        serde_json::json!({
            "model": MODEL_ID, "prompt": prompt, "max_tokens": 12, "temperature": 1.0,
            "seed": 7, "n": n, "stream": stream, "custody_token_ids": true,
        })
        .to_string()
    };
    let ask = |n: usize| -> serde_json::Value {
        let r = srv.post("/v1/completions", KEY, body(n, false).as_bytes());
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        serde_json::from_slice(&r.body).expect("json")
    };
    let texts = |v: &serde_json::Value| -> Vec<String> {
        let cs = v["choices"].as_array().expect("choices");
        for (i, c) in cs.iter().enumerate() {
            assert_eq!(
                c["index"].as_u64(),
                Some(i as u64),
                "choices in index order"
            );
        }
        cs.iter()
            .map(|c| c["text"].as_str().expect("text").to_owned())
            .collect()
    };
    let a = ask(4);
    let four = texts(&a);
    assert_eq!(four.len(), 4);
    assert!(
        four.iter().collect::<std::collections::BTreeSet<_>>().len() >= 2,
        "each choice its own seed stream: {four:?}"
    );
    assert_eq!(texts(&ask(4)), four, "the same seed, the same four choices");
    assert_eq!(texts(&ask(1))[0], four[0], "choice 0 is the n = 1 answer");
    let tokens: usize = a["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["token_ids"].as_array().expect("ids").len())
        .sum();
    assert_eq!(
        a["usage"]["completion_tokens"].as_u64(),
        Some(tokens as u64)
    );
    // Streamed: the chunks of each index concatenate to that choice.
    let r = srv.post("/v1/completions", KEY, body(4, true).as_bytes());
    assert_eq!(r.status, 200);
    let mut streamed: BTreeMap<u64, String> = BTreeMap::new();
    for line in String::from_utf8_lossy(&r.body).lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(data).expect("chunk");
        for c in v["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index");
            streamed
                .entry(i)
                .or_default()
                .push_str(c["text"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(streamed.into_values().collect::<Vec<_>>(), four);
    for n in [0, 9] {
        let r = srv.post("/v1/completions", KEY, body(n, false).as_bytes());
        assert_eq!(r.status, 400, "n = {n}");
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(v["error"]["param"], "n", "{v}");
    }
    let audit = srv.stop();
    let id0 = cmpl_engine_id(a["id"].as_str().expect("id"));
    let rows = read_table(&audit, "prefix_cache");
    let mut hits_on_id0 = std::collections::BTreeSet::new();
    let mut shared_by_id0 = 0;
    for b in &rows {
        let (ev, req, writer) = (
            col_str(b, "event"),
            col_u64(b, "request_id"),
            col_u64(b, "writer_request_id"),
        );
        for i in 0..b.num_rows() {
            match ev[i].as_deref() {
                Some("hit") if writer[i] == id0 => {
                    hits_on_id0.insert(req[i]);
                }
                Some("share") if req[i] == id0 => shared_by_id0 += 1,
                _ => {}
            }
        }
    }
    let prompt_pages = (tokenizer().encode(&prompt, false).expect("tokens").len() - 1) / 16;
    assert!(
        shared_by_id0 >= prompt_pages,
        "choice 0 computed and shared the prompt's full pages: {shared_by_id0} of {prompt_pages}"
    );
    for sibling in id0 + 1..=id0 + 3 {
        assert!(
            hits_on_id0.contains(&sibling),
            "choice {sibling} read choice 0's pages: {hits_on_id0:?}"
        );
    }
    let (exposure, _) = forensics(&audit);
    assert_eq!(exposure.affected_responses(), 0, "one tenant's choices");
    let decoding = read_table(&audit, "request_decoding");
    let ns: Vec<Option<u32>> = decoding.iter().flat_map(|b| col_u32(b, "n")).collect();
    assert_eq!(ns.iter().filter(|n| **n == Some(4)).count(), 12, "{ns:?}");
}

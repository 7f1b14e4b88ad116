//! `custody prefill`, `custody decode` and `custody generate --prefill`: the disaggregated roles'
//! flags, and what a node process is loaded from (its configuration, model, engine, audit log);
//! the process itself is `custody_runtime::disagg::node`.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use custody_audit::AuditSink;
use custody_audit::writer::AuditWriter;
use custody_runtime::disagg::checkpoints::PeerCheckpoints;
use custody_runtime::disagg::node::{self, NodeSetup};
use custody_runtime::disagg::proto::prefill_client::PrefillClient;
use custody_runtime::disagg::tls::Role as FleetRole;
use custody_runtime::tokenizer::StreamDecoder;
use custody_runtime::{Engine, Model, SamplingParams, Tokenizer};

use crate::audit_open::{AuditArgs, Serving, open_serving_audit};
use crate::common::{Common, fleet_security};
use crate::config::Config;
use crate::generate_cmd::GenerateArgs;

#[derive(Args, Debug)]
pub(crate) struct RoleArgs {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    audit: AuditArgs,
    /// Arm the config's `[unsafe_reproduction]` switches (the incident's faults, on purpose).
    /// Without this flag they are ignored; with it they are logged at ERROR and recorded in the
    /// audit log's `node_events`.
    #[arg(long)]
    unsafe_reproduction: bool,
    /// Reservation lease (decode): a reservation not committed within this many ms is aborted —
    /// its transport key invalidated first, then its pages freed.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Run WITHOUT an audit log (the default records into the default root): refused unless the
    /// config has `[audit] allow_no_audit = true` too; then logged at ERROR and reported by
    /// `/health/ready` as degraded.
    #[arg(long, conflicts_with_all = ["audit_dir", "audit_key"])]
    no_audit: bool,
}

/// The binary's half of a node process: its configuration, model, engine, audit log and
/// security, loaded from the flags and `--config` (the process itself:
/// `custody_runtime::disagg::node`).
fn load_role(
    a: &RoleArgs,
    role: &'static str,
) -> Result<(NodeSetup, Config, Option<Arc<AuditWriter>>)> {
    let Some(path) = &a.common.config else {
        bail!("custody {role} needs --config (see configs/disagg-{role}.toml)");
    };
    let cfg = Config::load(path)?;
    // Before the model loads: a refused --no-audit fails at once.
    let opened = open_serving_audit(&a.audit, a.no_audit, &cfg.audit, Serving::Fleet(role))?;
    let unsafe_ = cfg.unsafe_switches(a.unsafe_reproduction);
    let threads = if a.common.threads > 0 {
        a.common.threads
    } else {
        cfg.engine.threads
    };
    // The node's engine thread computes on the process's default pool (0: one per core).
    crate::common::set_default_pool(threads)?;
    let model = load_model(a.common.model.as_ref(), &cfg)?;
    let fingerprint = model.gguf().sha256_hex();
    let mut engine = Engine::new_with_unsafe(model, cfg.engine.clone(), &unsafe_)
        .with_context(|| format!("starting the {role} engine"))?;
    engine.set_release_fill(cfg.disagg.release_fill);
    let node = if a.audit.node != 0 {
        a.audit.node
    } else {
        cfg.audit.node
    };
    let security = fleet_security(&cfg.tls)?;
    let mut checkpoints = None;
    let mut proofs = None;
    let mut gate = None;
    if let Some(n) = &opened {
        if cfg.audit.require_cosignatures > 0 {
            gate = n.cosign.clone().map(|c| {
                Arc::new(crate::cosign_client::Gate(c))
                    as Arc<dyn custody_runtime::disagg::proofs::AuditGate>
            });
        }
        proofs = Some(Arc::new(crate::node_proofs::RootProofs {
            root: n.root.clone(),
            node: n.node,
            // Everything before this is an earlier incarnation's (request ids restart).
            from_seq: n.writer.sync().context("the audit log at start")?,
            writer: n.writer.clone(),
        })
            as Arc<dyn custody_runtime::disagg::proofs::NodeProofs>);
        let sink: Arc<dyn AuditSink> = n.writer.clone();
        engine = engine.with_audit(sink.clone());
        node::record_start(&mut engine, role, &fingerprint, &unsafe_);
        node::record_security(&mut engine, &security);
        // The pair keeps each other's checkpoints (where this node's disk cannot reach).
        let peer = if role == "decode" {
            "prefill"
        } else {
            "decode"
        };
        let book = custody_audit::checkpoint::PeerExchange::new(n.latest.clone(), sink, node, peer);
        checkpoints = Some(PeerCheckpoints {
            book: Arc::new(book),
            interval: n.checkpoint_interval,
        });
    }
    let setup = NodeSetup {
        engine,
        node,
        unsafe_,
        fingerprint,
        disagg: cfg.disagg.clone(),
        security,
        checkpoints,
        audit_off: opened.is_none(),
        proofs,
        gate,
    };
    Ok((setup, cfg, opened.map(|n| n.writer)))
}

/// The model `--model` or `[model] path` names, else the embedded one.
fn load_model(flag: Option<&std::path::PathBuf>, cfg: &Config) -> Result<Model> {
    let path = flag
        .cloned()
        .or(cfg.model.path.clone())
        .unwrap_or_else(custody_runtime::config::default_model_path);
    if !path.exists() {
        bail!(
            "model not found at {}: run scripts/fetch-model.sh or pass --model PATH",
            path.display()
        );
    }
    Model::load(&path).with_context(|| format!("loading model {}", path.display()))
}

/// After the node's service stopped: seal its log.
fn seal(audit: Option<Arc<AuditWriter>>) -> Result<()> {
    if let Some(w) = audit {
        crate::audit_open::stop_and_seal(&w)?;
    }
    Ok(())
}

pub(crate) fn decode(a: RoleArgs) -> Result<()> {
    let (setup, cfg, audit) = load_role(&a, "decode")?;
    if cfg.kv_offload.enabled() {
        bail!(
            "[kv_offload] applies to prefill nodes and custody serve (a decode node caches no prefix)"
        );
    }
    node::run_decode(setup, Duration::from_millis(a.lease_ms))?;
    seal(audit)
}

pub(crate) fn prefill(a: RoleArgs) -> Result<()> {
    let (mut setup, cfg, audit) = load_role(&a, "prefill")?;
    let offload = crate::common::offload_setup(&cfg, setup.node, setup.unsafe_.token_only_offload)?;
    let namespaces = node::prefix_namespaces(
        &mut setup.engine,
        &cfg.prefix_cache,
        setup.unsafe_.shared_prefix_cache,
        cfg.model
            .chat_template()
            .context("reading [model] chat_template_file")?,
        offload.as_ref(),
    )?;
    node::run_prefill(setup, namespaces)?;
    seal(audit)
}

pub(crate) fn generate_remote(a: GenerateArgs) -> Result<()> {
    let url = a.prefill.clone().unwrap_or_default();
    let cfg = match &a.common.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    let path = a
        .common
        .model
        .clone()
        .or(cfg.model.path.clone())
        .unwrap_or_else(custody_runtime::config::default_model_path);
    let gguf = custody_runtime::gguf::Gguf::open(&path)
        .with_context(|| format!("reading the tokenizer from {}", path.display()))?;
    let mut tokenizer = Tokenizer::from_gguf(&gguf)?;
    if let Some(t) = cfg
        .model
        .chat_template()
        .context("reading [model] chat_template_file")?
    {
        tokenizer.set_chat_template(t);
    }
    let prompt = crate::common::prompt_ids(&tokenizer, a.chat, a.system.as_deref(), &a.prompt)?;
    let req = custody_runtime::GenerateRequest {
        decoding: Default::default(),
        prompt,
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        stop_ids: tokenizer.stop_ids.clone(),
        tenant: a.tenant.clone(),
        cache: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        use custody_runtime::disagg::proto;
        use tokio_stream::StreamExt;
        // This client asserts the tenant: it must hold a front certificate the node accepts.
        let channel = fleet_security(&cfg.tls)?
            .channel(&url, FleetRole::Prefill)
            .await
            .with_context(|| format!("connecting to the prefill node at {url}"))?;
        let mut client = PrefillClient::new(channel);
        let t0 = Instant::now();
        let mut stream = client
            .generate(proto::GenerateRequest {
                tenant: req.tenant.clone(),
                prompt: req.prompt.clone(),
                max_tokens: req.max_tokens as u32,
                sampling: Some(proto::Sampling {
                    temperature: req.sampling.temperature,
                    top_k: req.sampling.top_k as u32,
                    top_p: req.sampling.top_p,
                    seed: req.sampling.seed,
                }),
                stop_ids: req.stop_ids.clone(),
                cache_salt: String::new(),
                route: None,
                decoding: None,
            })
            .await
            .map_err(|s| anyhow::anyhow!("request refused: {}", s.message()))?
            .into_inner();
        let mut out = std::io::stdout();
        let mut dec = StreamDecoder::default();
        let (mut n, mut ttft) = (0usize, None);
        while let Some(ev) = stream.next().await {
            let ev = ev.map_err(|s| anyhow::anyhow!("generation failed: {}", s.message()))?;
            let last = !ev.finish_reason.is_empty();
            if !last || ev.generated_tokens as usize > n {
                ttft.get_or_insert_with(|| t0.elapsed());
                n += 1;
                out.write_all(dec.push(&tokenizer, ev.token)?.as_bytes())?;
                out.flush()?;
            }
            if last {
                break;
            }
        }
        writeln!(out)?;
        eprintln!(
            "[{} prompt tokens, {n} generated via {url}; time to first token {:.0} ms, total {:.0} ms]",
            req.prompt.len(),
            ttft.unwrap_or_default().as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    })
}

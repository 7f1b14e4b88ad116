//! `custody generate`: one completion streamed to stdout (or through a prefill node).

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use custody_runtime::SamplingParams;
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::tokenizer::StreamDecoder;

use crate::audit_open::{AuditArgs, open_audit};
use crate::common::{Common, Loaded, load};

#[derive(Args, Debug)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// The prompt text.
    #[arg(long)]
    pub(crate) prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub(crate) chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    pub(crate) system: Option<String>,
    #[arg(long, default_value_t = 128)]
    pub(crate) max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub(crate) top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    #[command(flatten)]
    pub(crate) audit: AuditArgs,
    /// Send the request to a prefill node's front door (`http://host:port`) instead of running
    /// the model in this process (the model file is still read, for the tokenizer).
    #[arg(long)]
    pub(crate) prefill: Option<String>,
    /// Tenant id recorded with the request and every audit event of it (here or, with
    /// --prefill, on the pair's nodes).
    #[arg(long, default_value = "cli")]
    pub(crate) tenant: String,
}

pub(crate) fn generate(a: GenerateArgs) -> Result<()> {
    if a.prefill.is_some() {
        return crate::disagg_cmd::generate_remote(a);
    }
    let Loaded {
        mut engine,
        tokenizer,
        pool,
    } = load(&a.common, None)?;
    let audit = open_audit(&a.audit, a.common.config.as_deref())?;
    if let Some(w) = &audit {
        engine = engine.with_audit(w.clone());
    }
    let prompt = crate::common::prompt_ids(&tokenizer, a.chat, a.system.as_deref(), &a.prompt)?;
    let req = GenerateRequest {
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
    let n_prompt = req.prompt.len();
    let id = engine.submit(req).context("request rejected")?;
    let t0 = Instant::now();
    let mut first_token_at = None;
    let mut n_gen = 0usize;
    let mut dec = StreamDecoder::default();
    let mut out = std::io::stdout();
    pool.install(|| -> Result<()> {
        while engine.has_work() {
            for ev in engine.step() {
                match ev {
                    Event::Token { id: rid, token, .. } if rid == id => {
                        first_token_at.get_or_insert_with(|| t0.elapsed());
                        n_gen += 1;
                        out.write_all(dec.push(&tokenizer, token)?.as_bytes())?;
                        out.flush()?;
                    }
                    Event::Failed { error, .. } => {
                        bail!("generation failed: integrity error: {error}")
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    })?;
    writeln!(out)?;
    if let Some(w) = audit {
        w.close().context("sealing the audit log")?;
    }
    let total = t0.elapsed();
    let ttft = first_token_at.unwrap_or(total);
    let decode_s = (total - ttft).as_secs_f64();
    eprintln!(
        "[{} prompt tokens, {} generated; prefill {:.1} tok/s, decode {:.1} tok/s]",
        n_prompt,
        n_gen,
        n_prompt as f64 / ttft.as_secs_f64(),
        if n_gen > 1 && decode_s > 0.0 {
            (n_gen - 1) as f64 / decode_s
        } else {
            0.0
        }
    );
    Ok(())
}

//! What an output constraint costs (`custody bench --constraint-cost`): the same sequences
//! decoded without a JSON-schema constraint, with it (masks computed ahead, while the forward
//! pass runs: `grammar::ahead`), and with it computing each mask on the step that needs it,
//! rotating which runs first in one run; one mask timed alone, and the schema's compile time
//! (what it adds to a constrained request's time to first token).

use std::time::Instant;

use crate::{Context, Result, bail};
use custody_runtime::decoding::Decoding;
use custody_runtime::engine::{Event, GenerateRequest};
use custody_runtime::grammar::{ConstraintKind, ConstraintSpec, Grammars, ahead};
use custody_runtime::{Engine, SamplingParams};

use crate::stats::median;

/// A schema whose documents are longer than any measured decode (at least 256 items), so no
/// constrained sequence ends before the unconstrained ones: an array of small objects, the
/// shape of a typical extraction answer.
pub const SCHEMA: &str = r#"{"type": "array", "minItems": 256, "items": {"type": "object",
 "properties": {"name": {"type": "string", "maxLength": 16},
  "age": {"type": "integer", "minimum": 0, "maximum": 120},
  "city": {"enum": ["Paris", "London", "Berlin", "Madrid"]}},
 "required": ["name", "age", "city"], "additionalProperties": false}}"#;

/// Medians over the repetitions.
#[derive(Debug)]
pub struct ConstraintCost {
    pub batch: usize,
    pub plain_decode_tok_s: f64,
    /// Masks computed ahead (the default).
    pub constrained_decode_tok_s: f64,
    /// Each mask computed on the step that needs it.
    pub on_step_decode_tok_s: f64,
    wall_fraction: f64,
    on_step_wall_fraction: f64,
    /// What the constraint cost the step per token, µs (`grammar::ahead::OnStep`: the mask —
    /// the wait for whatever was left of the job ahead, or all of it on the step — its
    /// application to the logits, the advance). Summed over sequences: at 8 sequences, several
    /// threads may be at it at once.
    pub step_wait_ahead_us: f64,
    pub step_wait_on_step_us: f64,
    /// Compiling [`SCHEMA`] for one request, ms.
    pub compile_ms: f64,
    /// One sequence's mask and advance, timed alone over [`MASK_STEPS`] tokens, µs.
    pub mask_us: f64,
    /// The compute pool's threads (two or more masks in a step are spread over them).
    pub threads: usize,
}

/// Tokens walked when timing the masks alone.
pub const MASK_STEPS: usize = 256;

impl ConstraintCost {
    /// The share of a constrained decode step spent on the constraint, by wall time: the
    /// median over repetitions of `1 − constrained / plain` within each repetition (paired, so
    /// the host's drift between repetitions cancels; noisy below a few per cent).
    pub fn wall_fraction_of_step(&self) -> f64 {
        self.wall_fraction
    }

    /// The same with every mask computed on the step.
    pub fn on_step_wall_fraction(&self) -> f64 {
        self.on_step_wall_fraction
    }

    /// What the constraint cost the step, as a share of a constrained step: masks computed
    /// ahead, then masks computed on the step (`batch` tokens a step, summed: an upper bound
    /// when several threads are at it at once).
    pub fn waited_fraction_of_step(&self) -> (f64, f64) {
        let step_us = 1e6 * self.batch as f64;
        (
            self.step_wait_ahead_us * self.batch as f64 / (step_us / self.constrained_decode_tok_s),
            self.step_wait_on_step_us * self.batch as f64 / (step_us / self.on_step_decode_tok_s),
        )
    }

    /// The same from the masks timed alone: `batch` masks per plain decode step, one per
    /// thread at a time when there are two or more.
    pub fn mask_fraction_of_step(&self) -> f64 {
        let step_us = 1e6 * self.batch as f64 / self.plain_decode_tok_s;
        let rounds = if self.batch >= 2 {
            self.batch.div_ceil(self.threads.max(1))
        } else {
            1
        };
        rounds as f64 * self.mask_us / step_us
    }
}

/// Decode tok/s of `batch` sequences of `ids`, `gen_tokens` each after the first.
fn decode_tok_s(
    engine: &mut Engine,
    ids: &[u32],
    gen_tokens: usize,
    batch: usize,
    decoding: &dyn Fn() -> Result<Decoding>,
) -> Result<f64> {
    for _ in 0..batch {
        engine.submit(GenerateRequest {
            decoding: decoding()?,
            prompt: ids.to_vec(),
            max_tokens: gen_tokens + 1,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            tenant: "bench".into(),
            cache: None,
        })?;
    }
    let mut first = std::collections::HashSet::new();
    let mut t_decode = None;
    let mut decoded = 0usize;
    // Bounded: each step makes progress or the engine has no work left.
    for _ in 0..batch * (ids.len() + gen_tokens + 2) {
        if !engine.has_work() {
            break;
        }
        for ev in engine.step() {
            match ev {
                Event::Token { id, .. } => {
                    if !first.insert(id) {
                        decoded += 1;
                    }
                }
                Event::Finished { .. } => {}
                other => bail!("benchmark request ended early: {other:?}"),
            }
        }
        if t_decode.is_none() && first.len() == batch {
            t_decode = Some(Instant::now());
        }
    }
    let t = t_decode.context("the prompts were never processed")?;
    if decoded != batch * gen_tokens {
        bail!(
            "expected {} decoded tokens, got {decoded}",
            batch * gen_tokens
        );
    }
    Ok(decoded as f64 / t.elapsed().as_secs_f64())
}

/// Plain and constrained, alternating which runs first, `reps` times, at `batch` sequences.
pub fn measure(
    engine: &mut Engine,
    grammars: &Grammars,
    ids: &[u32],
    gen_tokens: usize,
    batch: usize,
    reps: usize,
) -> Result<ConstraintCost> {
    let compiled = || -> Result<Decoding> {
        Ok(Decoding {
            constraint: Some(grammars.compile(ConstraintSpec {
                kind: ConstraintKind::JsonSchema,
                source: SCHEMA.into(),
            })?),
            ..Decoding::default()
        })
    };
    let mut compile_ms = Vec::new();
    // Per mode: plain, constrained with masks ahead, constrained with masks on the step.
    let mut tok_s: [Vec<f64>; 3] = Default::default();
    // Per mode: what the constraints cost the steps that ran them.
    let mut waited = [ahead::OnStep::default(); 3];
    for rep in 0..reps {
        let t = Instant::now();
        compiled()?;
        compile_ms.push(t.elapsed().as_secs_f64() * 1e3);
        for k in 0..3 {
            let mode = (rep + k) % 3;
            custody_runtime::grammar::ahead::set_enabled(mode != 2);
            let plain = || Ok(Decoding::default());
            let decoding: &dyn Fn() -> Result<Decoding> =
                if mode == 0 { &plain } else { &compiled };
            let before = ahead::OnStep::now();
            let r = decode_tok_s(engine, ids, gen_tokens, batch, decoding);
            let w = ahead::OnStep::now().since(before);
            waited[mode].masks += w.masks;
            waited[mode].on_step_ns += w.on_step_ns;
            custody_runtime::grammar::ahead::set_enabled(true);
            tok_s[mode].push(r?);
        }
    }
    // Timed alone, on this thread: what a mask costs wherever it is computed.
    custody_runtime::grammar::ahead::set_enabled(false);
    let alone = mask_alone_us(engine, &compiled);
    custody_runtime::grammar::ahead::set_enabled(true);
    let [plain, constrained, on_step] = tok_s;
    let paired = |c: &[f64]| median(plain.iter().zip(c).map(|(p, c)| 1.0 - c / p).collect());
    Ok(ConstraintCost {
        wall_fraction: paired(&constrained),
        step_wait_ahead_us: waited[1].mean_on_step_us(),
        step_wait_on_step_us: waited[2].mean_on_step_us(),
        on_step_wall_fraction: paired(&on_step),
        threads: custody_runtime::par::current_num_threads(),
        mask_us: alone?,
        batch,
        plain_decode_tok_s: median(plain),
        constrained_decode_tok_s: median(constrained),
        on_step_decode_tok_s: median(on_step),
        compile_ms: median(compile_ms),
    })
}

/// One sequence's mask and advance over [`MASK_STEPS`] tokens, µs each.
fn mask_alone_us(engine: &Engine, compiled: &dyn Fn() -> Result<Decoding>) -> Result<f64> {
    let vocab = engine.model().config.vocab_size;
    let mut c = compiled()?.constraint.context("compiled")?;
    let mut logits = vec![0.0f32; vocab];
    let t = Instant::now();
    for _ in 0..MASK_STEPS {
        logits.fill(0.0);
        c.mask(&mut logits)?;
        // The lowest allowed id (the logits are flat): a walk through the schema's states.
        let next = logits
            .iter()
            .position(|l| l.is_finite())
            .context("a mask allows nothing")?;
        c.advance(next as u32)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / MASK_STEPS as f64)
}

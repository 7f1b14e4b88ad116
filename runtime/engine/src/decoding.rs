//! What a request asks of each sampled token beyond temperature and nucleus: logit biases, the
//! presence and frequency penalties, an output constraint, and log-probabilities returned with
//! each token.
//!
//! The order, per step, on the logits the forward pass produced:
//! 1. `logit_bias` added (OpenAI: "added to the logits prior to sampling");
//! 2. penalties subtracted: `count × frequency_penalty + (count > 0) × presence_penalty`, the
//!    counts over this request's output so far (OpenAI's formula);
//! 3. the constraint's mask: tokens it does not allow go to −∞;
//! 4. **log-probabilities are taken here** — `log_softmax` of these logits, after the bias, the
//!    penalties and the mask, before temperature and `top_p` (vLLM's `processed_logprobs`
//!    minus its temperature step): what the sampler chose from, independent of how boldly;
//! 5. temperature and `top_p`, then the draw ([`crate::sampling::Sampler`]).
//!
//! A request that asks for none of it pays nothing: the logits are not copied or touched.

use std::collections::HashMap;

use crate::grammar::{Constraint, ConstraintSpec, GrammarError};

/// Most `logit_bias` entries a request may carry.
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 300;
/// Most alternatives returned per token (OpenAI's chat limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One `logit_bias` entry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitBias {
    pub token: u32,
    /// Added to the token's logit, in [−100, 100].
    pub bias: f32,
}

/// The per-token options of one request ([`crate::engine::GenerateRequest::decoding`]).
#[derive(Clone, Debug, Default)]
pub struct Decoding {
    pub logit_bias: Vec<LogitBias>,
    /// In [−2, 2].
    pub presence_penalty: f32,
    /// In [−2, 2].
    pub frequency_penalty: f32,
    /// `Some(k)`: return each sampled token's log-probability and the `k` most likely
    /// alternatives (`k` ≤ [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
    /// Compiled by the caller (`Grammars::compile`), off the engine thread.
    pub constraint: Option<Constraint>,
    /// Choices the client asked for (`n`; 0 and 1 both mean one). Each choice is its own
    /// request to the engine (its own seed stream, constraint state and pages past the shared
    /// prompt pages); this is what the audit row records.
    pub n: u32,
}

/// Options out of range.
/// (`f32`s rendered as given: they may be NaN.)
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodingError {
    #[error("logit_bias has {got} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")]
    TooManyBiases { got: usize },
    #[error("logit_bias for token {token} is {bias}; it must be in [-100, 100]")]
    BiasRange { token: u32, bias: String },
    #[error("logit_bias names token {token}, outside the vocabulary of {vocab}")]
    BiasToken { token: u32, vocab: usize },
    #[error("{name} must be in [-2, 2], got {got}")]
    Penalty { name: &'static str, got: String },
    #[error("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {got}")]
    TopLogprobs { got: usize },
}

impl DecodingError {
    /// The request field the error is about.
    pub fn param(&self) -> &'static str {
        match self {
            Self::TooManyBiases { .. } | Self::BiasRange { .. } | Self::BiasToken { .. } => {
                "logit_bias"
            }
            Self::Penalty { name, .. } => name,
            Self::TopLogprobs { .. } => "top_logprobs",
        }
    }
}

impl Decoding {
    pub fn validate(&self, vocab: usize) -> Result<(), DecodingError> {
        if self.logit_bias.len() > MAX_LOGIT_BIAS_ENTRIES {
            return Err(DecodingError::TooManyBiases {
                got: self.logit_bias.len(),
            });
        }
        for b in &self.logit_bias {
            if !(-100.0..=100.0).contains(&b.bias) {
                return Err(DecodingError::BiasRange {
                    token: b.token,
                    bias: b.bias.to_string(),
                });
            }
            if b.token as usize >= vocab {
                return Err(DecodingError::BiasToken {
                    token: b.token,
                    vocab,
                });
            }
        }
        for (name, got) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&got) {
                return Err(DecodingError::Penalty {
                    name,
                    got: got.to_string(),
                });
            }
        }
        if let Some(k) = self.logprobs
            && k > MAX_TOP_LOGPROBS
        {
            return Err(DecodingError::TopLogprobs { got: k });
        }
        Ok(())
    }

    /// The `request_decoding` audit row for request `id`, or `None` when it asks for nothing
    /// (a plain request has no row).
    pub fn record(
        &self,
        id: u64,
        tenant: &str,
        ts_ns: custody_audit::MonoNs,
    ) -> Option<custody_audit::DecodingRecord> {
        if !self.touches_logits() && self.logprobs.is_none() && self.n <= 1 {
            return None;
        }
        let spec = self.constraint.as_ref().map(Constraint::spec);
        Some(custody_audit::DecodingRecord {
            ts_ns,
            request: id,
            tenant: tenant.into(),
            constraint_kind: spec.map(|s| s.kind.name()),
            constraint_sha256: spec.map(ConstraintSpec::sha256_hex),
            n: self.n.max(1),
            top_logprobs: self.logprobs.map(|k| k as u32),
            logit_bias_tokens: self.logit_bias.len() as u32,
            presence_penalty_milli: (self.presence_penalty * 1000.0).round() as i32,
            frequency_penalty_milli: (self.frequency_penalty * 1000.0).round() as i32,
        })
    }

    /// Whether the logits go to the sampler as the forward pass made them.
    fn touches_logits(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.constraint.is_some()
    }
}

/// A token's log-probability and the alternatives asked for, most likely first (ties by id).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<TopLogprob>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// One sequence's decoding state: its options and the counts its penalties need.
#[derive(Clone, Debug, Default)]
pub(crate) struct DecodeState {
    decoding: Decoding,
    /// Output token → times produced. At most one entry per output token (bounded by the
    /// request's `max_tokens`), kept only when a penalty is set.
    counts: HashMap<u32, u32>,
}

impl DecodeState {
    pub(crate) fn new(decoding: Decoding) -> Self {
        Self {
            decoding,
            counts: HashMap::new(),
        }
    }

    /// Whether it has an output constraint (masks to compute).
    pub(crate) fn constrained(&self) -> bool {
        self.decoding.constraint.is_some()
    }

    /// Steps 1–3 of the module's order, in place.
    pub(crate) fn shape(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        if !self.decoding.touches_logits() {
            return Ok(());
        }
        for b in &self.decoding.logit_bias {
            if let Some(l) = logits.get_mut(b.token as usize) {
                *l += b.bias;
            }
        }
        let (fp, pp) = (
            self.decoding.frequency_penalty,
            self.decoding.presence_penalty,
        );
        for (&t, &c) in &self.counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= c as f32 * fp + pp;
            }
        }
        if let Some(c) = &mut self.decoding.constraint {
            c.mask(logits)?;
        }
        Ok(())
    }

    /// Step 4: the sampled token's log-probability and the alternatives, if asked for.
    pub(crate) fn logprobs(&self, logits: &[f32], token: u32) -> Option<TokenLogprobs> {
        let k = self.decoding.logprobs?;
        Some(logprobs_of(logits, token, k))
    }

    /// Records the sampled token. `end`: it ends the generation (a stop token), which the
    /// constraint is not advanced past.
    pub(crate) fn accept(&mut self, token: u32, end: bool) -> Result<(), GrammarError> {
        if self.decoding.presence_penalty != 0.0 || self.decoding.frequency_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
        if !end && let Some(c) = &mut self.decoding.constraint {
            c.advance(token)?;
        }
        Ok(())
    }

    /// Whether the constraint is complete, so the output must end here.
    pub(crate) fn complete(&self) -> bool {
        self.decoding
            .constraint
            .as_ref()
            .is_some_and(Constraint::is_complete)
    }
}

/// `log_softmax(logits)[token]` and the `k` largest entries, in f64 for the normaliser.
pub fn logprobs_of(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .map(|&l| f64::from(l - max).exp())
        .sum::<f64>();
    let log_z = f64::from(max) + sum.ln();
    let lp = |l: f32| (f64::from(l) - log_z) as f32;
    let mut top = Vec::with_capacity(k);
    if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let by = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let k = k.min(idx.len());
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, by);
            idx.truncate(k);
        }
        idx.sort_unstable_by(by);
        top.extend(idx.into_iter().map(|t| TopLogprob {
            token: t,
            logprob: lp(logits[t as usize]),
        }));
    }
    TokenLogprobs {
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_log_softmax_and_top_k_is_ordered() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NEG_INFINITY];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let got = logprobs_of(&logits, 2, 3);
        assert!((f64::from(got.logprob) - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = got.top.iter().map(|t| t.token).collect();
        assert_eq!(ids, [1, 3, 2], "descending, ties by id");
        assert_eq!(logprobs_of(&logits, 4, 0).logprob, f32::NEG_INFINITY);
        assert!(logprobs_of(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn bias_and_penalties_follow_openais_formula() {
        let mut s = DecodeState::new(Decoding {
            logit_bias: vec![LogitBias {
                token: 0,
                bias: 5.0,
            }],
            presence_penalty: 0.5,
            frequency_penalty: 1.0,
            ..Decoding::default()
        });
        for t in [1, 1, 2] {
            s.accept(t, false).expect("no constraint");
        }
        let mut l = [0.0f32; 4];
        s.shape(&mut l).expect("no constraint");
        assert_eq!(l, [5.0, -2.5, -1.5, 0.0]);
    }

    #[test]
    fn nothing_asked_leaves_the_logits_alone() {
        let mut s = DecodeState::new(Decoding::default());
        let mut l = [1.0f32, 2.0];
        s.accept(1, false).expect("no constraint");
        s.shape(&mut l).expect("no constraint");
        assert_eq!(l, [1.0, 2.0]);
        assert!(s.logprobs(&l, 1).is_none());
    }

    #[test]
    fn out_of_range_options_are_refused_by_name() {
        let bad = [
            Decoding {
                logit_bias: vec![LogitBias {
                    token: 9,
                    bias: 1.0,
                }],
                ..Decoding::default()
            },
            Decoding {
                logit_bias: vec![LogitBias {
                    token: 0,
                    bias: 101.0,
                }],
                ..Decoding::default()
            },
            Decoding {
                presence_penalty: 2.5,
                ..Decoding::default()
            },
            Decoding {
                frequency_penalty: f32::NAN,
                ..Decoding::default()
            },
            Decoding {
                logprobs: Some(21),
                ..Decoding::default()
            },
        ];
        let params: Vec<&str> = bad
            .iter()
            .map(|d| d.validate(8).expect_err("out of range").param())
            .collect();
        assert_eq!(
            params,
            [
                "logit_bias",
                "logit_bias",
                "presence_penalty",
                "frequency_penalty",
                "top_logprobs"
            ]
        );
        assert!(Decoding::default().validate(8).is_ok());
    }
}

//! Token sampling: greedy, temperature, top-k, top-p, with a seeded, portable PRNG so that a
//! given (seed, logits) sequence always yields the same tokens on every machine and version.

/// Sampling parameters of one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 (or below) means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Sampling parameters out of range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SamplingError {
    /// `got`: the value as given (rendered: it may be NaN).
    #[error("temperature must be a finite number >= 0, got {got}")]
    Temperature { got: String },
    #[error("top_p must be in (0, 1], got {got}")]
    TopP { got: String },
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature {
                got: self.temperature.to_string(),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP {
                got: self.top_p.to_string(),
            });
        }
        Ok(())
    }
}

/// SplitMix64: tiny, fast, and fully specified (so seeds are reproducible across versions).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Per-request sampler state.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    buf: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            rng: Rng::new(params.seed),
            buf: Vec::new(),
        }
    }

    /// Pick the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty());
        let p = self.params;
        if p.temperature <= 0.0 {
            return custody_kernels::ops::argmax(logits).unwrap_or(0) as u32;
        }
        self.buf.clear();
        self.buf.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l / p.temperature)),
        );
        // Sort descending by logit, ties by id, so the candidate order is deterministic.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.buf.len() {
            self.buf.select_nth_unstable_by(p.top_k - 1, by_logit);
            self.buf.truncate(p.top_k);
        }
        self.buf.sort_unstable_by(by_logit);
        let max = self.buf[0].1;
        let mut sum = 0.0f64;
        for c in &mut self.buf {
            c.1 = (c.1 - max).exp();
            sum += f64::from(c.1);
        }
        // Nucleus: the smallest prefix whose probability mass reaches top_p.
        let mut keep = self.buf.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0f64;
            for (i, c) in self.buf.iter().enumerate() {
                acc += f64::from(c.1) / sum;
                if acc >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = self.buf[..keep].iter().map(|c| f64::from(c.1)).sum();
        let mut r = self.rng.next_f64() * mass;
        for c in &self.buf[..keep] {
            r -= f64::from(c.1);
            if r < 0.0 {
                return c.0;
            }
        }
        self.buf[keep - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 2.9]), 1);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
        };
        let run = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(p), run(p));
        assert_ne!(run(p), run(SamplingParams { seed: 43, ..p }));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.9, 0.0, -1.0, -2.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 1,
        });
        for _ in 0..200 {
            assert!(s.sample(&logits) < 2);
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.3,
            seed: 1,
        });
        for _ in 0..200 {
            assert_eq!(s.sample(&logits), 0, "top_p 0.3 keeps only the top token");
        }
    }

    #[test]
    fn rejects_bad_params() {
        assert!(
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
    }
}

//! The router's seeded random source.
//!
//! SplitMix64 (Steele, Lea and Flood, 2014): one 64-bit word of state, a full period of 2^64,
//! and good enough statistical quality for sampling two candidates. It is here rather than a
//! dependency so that a choice is reproducible from its seed on every platform and version: the
//! audit can replay a routing decision from the seed it recorded.

/// A SplitMix64 generator; the tuple field is its state.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

/// The golden-ratio increment SplitMix64 adds to its state each step.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    /// A generator whose sequence is fully determined by `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value uniform in `0..n` (bias below 2^-64 × n, negligible for candidate counts), by the
    /// multiply-high method: no division and no rejection loop, so one draw per call.
    ///
    /// # Panics
    /// If `n == 0`: there is nothing to choose from, which is the caller's bug.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "SplitMix64::below(0): empty range");
        let wide = u128::from(self.next_u64()) * u128::from(n);
        // The high word of a 64×64 product is < n, so it fits in u64.
        (wide >> 64) as u64
    }

    /// A value uniform in `[0, 1)` with 53 bits of precision (the simulation's arrival times).
    pub fn unit_f64(&mut self) -> f64 {
        const MANTISSA_BITS: u32 = 53;
        let bits = self.next_u64() >> (64 - MANTISSA_BITS);
        bits as f64 / (1u64 << MANTISSA_BITS) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_sequence_for_seed_zero() {
        // From the reference implementation (Vigna, splitmix64.c) seeded with 0.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(rng.next_u64(), 0x06C4_5D18_8009_454F);
    }

    #[test]
    fn below_stays_in_range_and_covers_it_evenly() {
        const BUCKETS: u64 = 10;
        const DRAWS: u32 = 100_000;
        let mut rng = SplitMix64::new(42);
        let mut counts = [0u32; BUCKETS as usize];
        for _ in 0..DRAWS {
            let v = rng.below(BUCKETS);
            assert!(v < BUCKETS);
            counts[v as usize] += 1;
        }
        let expected = DRAWS / BUCKETS as u32;
        for (bucket, &count) in counts.iter().enumerate() {
            // ±5% of 10_000 is over 15 standard deviations: fails only if the method is biased.
            assert!(
                count.abs_diff(expected) < expected / 20,
                "bucket {bucket}: {count}"
            );
        }
    }

    #[test]
    fn below_one_is_always_zero_and_zero_panics() {
        let mut rng = SplitMix64::new(7);
        assert!((0..100).all(|_| rng.below(1) == 0));
        assert!(std::panic::catch_unwind(move || rng.below(0)).is_err());
    }

    #[test]
    fn unit_f64_is_in_the_half_open_interval() {
        let mut rng = SplitMix64::new(3);
        let mut sum = 0.0;
        for _ in 0..10_000 {
            let u = rng.unit_f64();
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        let mean = sum / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }
}

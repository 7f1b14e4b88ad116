//! Region keys that are unpredictable and never reused, in O(1) memory.
//!
//! The n-th key a target issues is `P(n)`, where `P` is a keyed permutation of the 32-bit key
//! space: a 4-round balanced Feistel network over 16-bit halves whose round function is SipHash
//! keyed at random per target (`std`'s `RandomState`: a PRF made for exactly this kind of keyed
//! hashing; Luby–Rackoff: 4 rounds of a PRF give a strong pseudo-random permutation). Because
//! `P` is a bijection, distinct counters give distinct keys: no key is ever issued twice, and
//! the target need not remember the keys it issued — only the counter, and the keys still live.
//! Whether a key was ever issued is `P⁻¹(key) < next`. Written here rather than taken from a
//! crate because the one thing needed — a keyed 32-bit permutation with an inverse — is ten
//! lines over a PRF `std` already has (format-preserving-encryption crates bring AES and
//! radix machinery for arbitrary domains).

use std::hash::{BuildHasher, RandomState};

/// Rounds of the Feistel network (4: a strong PRP from a PRF).
const ROUNDS: u32 = 4;

/// The key sequence of one target.
#[derive(Debug)]
pub(super) struct KeySequence {
    prf: RandomState,
    /// Counter of the next key (keys `P(0..next)` were issued, or skipped for being 0).
    next: u64,
}

/// Every 32-bit key but 0 has been issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the target's 2^32 - 1 region keys are all issued")]
pub(super) struct KeysExhausted;

impl KeySequence {
    pub(super) fn new() -> Self {
        Self {
            prf: RandomState::new(),
            next: 0,
        }
    }

    /// The next key: never 0 (no key), never one issued before.
    pub(super) fn issue(&mut self) -> Result<u32, KeysExhausted> {
        // At most two counters per key: `P` maps exactly one counter to 0.
        while self.next <= u64::from(u32::MAX) {
            let key = self.permute(self.next as u32);
            self.next += 1;
            if key != 0 {
                return Ok(key);
            }
        }
        Err(KeysExhausted)
    }

    /// Whether `key` was issued by this sequence (O(1): its counter is below the next one).
    pub(super) fn was_issued(&self, key: u32) -> bool {
        key != 0 && u64::from(self.invert(key)) < self.next
    }

    fn round(&self, round: u32, half: u16) -> u16 {
        // Truncation to the half's width is the point: the PRF's output is 64 bits.
        self.prf.hash_one((round, half)) as u16
    }

    fn permute(&self, x: u32) -> u32 {
        let (mut l, mut r) = ((x >> 16) as u16, x as u16);
        for i in 0..ROUNDS {
            (l, r) = (r, l ^ self.round(i, r));
        }
        (u32::from(l) << 16) | u32::from(r)
    }

    fn invert(&self, y: u32) -> u32 {
        let (mut l, mut r) = ((y >> 16) as u16, y as u16);
        for i in (0..ROUNDS).rev() {
            (l, r) = (r ^ self.round(i, l), l);
        }
        (u32::from(l) << 16) | u32::from(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_undoes_the_permutation() {
        let s = KeySequence::new();
        for x in (0..u32::MAX).step_by(65_537).chain([0, 1, u32::MAX]) {
            assert_eq!(s.invert(s.permute(x)), x);
        }
    }

    #[test]
    fn keys_are_distinct_nonzero_and_known_as_issued() {
        let mut s = KeySequence::new();
        let keys: Vec<u32> = (0..10_000).map(|_| s.issue().expect("key")).collect();
        let unique: std::collections::HashSet<u32> = keys.iter().copied().collect();
        assert_eq!(unique.len(), keys.len());
        assert!(keys.iter().all(|&k| k != 0 && s.was_issued(k)));
        let fresh = s.permute(s.next as u32 + 5);
        assert!(
            !s.was_issued(fresh),
            "a key of a later counter is not issued yet"
        );
        assert!(!s.was_issued(0));
    }

    #[test]
    fn two_targets_draw_different_sequences() {
        let (mut a, mut b) = (KeySequence::new(), KeySequence::new());
        let ka: Vec<u32> = (0..8).map(|_| a.issue().expect("key")).collect();
        let kb: Vec<u32> = (0..8).map(|_| b.issue().expect("key")).collect();
        assert_ne!(ka, kb, "keyed at random per target");
    }
}

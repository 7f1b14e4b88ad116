//! The choices: which prefill node gets a prompt, which decode node receives its KV cache.
//!
//! # Prefill: SGLang's cache-aware policy, restated
//!
//! A prefill node that already holds a prompt's prefix skips recomputing it, so sending a
//! prompt where its prefix lives saves the most work; but chasing cache hits alone piles load on
//! the nodes that hold popular prefixes. The policy, given the routable nodes and the prompt's
//! chain keys (load = `queued_requests`):
//!
//! 1. **Imbalance guard.** If `max_load − min_load > balance_abs_requests` *and*
//!    `max_load > balance_rel × min_load`, the fleet is imbalanced: pick the least loaded node
//!    (reason `imbalanced`), whatever the cache says. Both conditions, so that neither a small
//!    absolute gap on idle nodes nor a small relative gap on busy ones triggers it.
//! 2. **No prefix.** If the prompt has no full page (`keys` is empty), pick the least loaded
//!    (`no_prefix`).
//! 3. **Affinity.** Find the node whose [`PrefixIndex::matched`] is longest (ties: lower load,
//!    then lower node id). If `matched / keys.len() >= cache_match_ratio`, pick it
//!    (`cache_affinity`); otherwise the hit is too small to be worth the queue, so pick the
//!    least loaded (`least_loaded`).
//!
//! Least loaded means fewest `queued_requests`, ties broken by more `free_pages`, then lower node
//! id, so that every choice is deterministic.
//!
//! # Decode: power of two choices
//!
//! Decode nodes are limited by KV pages. Only nodes with `free_pages >= need_pages` are
//! considered. Picking the emptiest of all needs fresh reports from every node and herds
//! concurrent routers onto the same one; picking at random leaves a long tail of full nodes.
//! Sampling two distinct fitting nodes uniformly and taking the one with more free pages
//! (ties: fewer live requests, then lower node id) gets most of the balance of the former with
//! the robustness of the latter (Mitzenmacher, 2001). [`choose_decode_random`] is the uniform
//! baseline the simulation compares against.

use crate::index::PrefixIndex;
use crate::rng::SplitMix64;
use crate::{ChainKey, NodeId};
use std::cmp::Reverse;

/// A routable prefill node as the router last heard from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillCandidate {
    /// The node.
    pub node: NodeId,
    /// Requests waiting or in prefill on it: the load.
    pub queued_requests: u32,
    /// Free KV pages on it: the tie breaker between equally loaded nodes.
    pub free_pages: u32,
}

/// A routable decode node as the router last heard from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeCandidate {
    /// The node.
    pub node: NodeId,
    /// Free KV pages on it: what a request's transfer needs.
    pub free_pages: u32,
    /// Requests it is decoding: the tie breaker.
    pub live_requests: u32,
}

/// The prefill policy's knobs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    /// The fraction of a prompt's pages a node must hold for affinity to win, in (0, 1].
    pub cache_match_ratio: f64,
    /// The load gap, in requests, above which the fleet may be imbalanced.
    pub balance_abs_requests: u32,
    /// The load ratio, at least 1, above which the fleet may be imbalanced.
    pub balance_rel: f64,
}

impl Default for PolicyConfig {
    /// SGLang's defaults: half the prompt cached, a gap of more than 8 requests and 1.5×.
    fn default() -> Self {
        Self {
            cache_match_ratio: 0.5,
            balance_abs_requests: 8,
            balance_rel: 1.5,
        }
    }
}

/// Why a [`PolicyConfig`] is unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    /// A ratio of 0 would call any node a hit; above 1 none.
    #[error("cache_match_ratio must be in (0, 1], got {ratio}")]
    CacheMatchRatio {
        /// The value given.
        ratio: f64,
    },
    /// Below 1 every fleet, even a perfectly balanced one, would look imbalanced.
    #[error("balance_rel must be finite and >= 1, got {rel}")]
    BalanceRel {
        /// The value given.
        rel: f64,
    },
}

impl PolicyConfig {
    /// Checks the ranges in the field docs (NaN is out of every range).
    pub fn validate(&self) -> Result<(), PolicyError> {
        let ratio = self.cache_match_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(PolicyError::CacheMatchRatio { ratio });
        }
        let rel = self.balance_rel;
        if !(rel.is_finite() && rel >= 1.0) {
            return Err(PolicyError::BalanceRel { rel });
        }
        Ok(())
    }
}

/// Why the prefill node was chosen, for the audit record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillReason {
    /// It holds enough of the prompt's prefix.
    CacheAffinity,
    /// No node held enough of the prefix.
    LeastLoaded,
    /// The imbalance guard overrode the cache.
    Imbalanced,
    /// The prompt had no full page to match.
    NoPrefix,
}

impl PrefillReason {
    /// The stable name the audit record and metrics use.
    pub fn name(self) -> &'static str {
        match self {
            Self::CacheAffinity => "cache_affinity",
            Self::LeastLoaded => "least_loaded",
            Self::Imbalanced => "imbalanced",
            Self::NoPrefix => "no_prefix",
        }
    }
}

/// A prefill decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillChoice {
    /// The chosen node.
    pub node: NodeId,
    /// Why.
    pub reason: PrefillReason,
    /// How many of the prompt's pages the index believes the node holds.
    pub matched_pages: usize,
    /// How many full pages the prompt has.
    pub prompt_pages: usize,
}

/// Chooses the prefill node for a prompt with these chain keys (see the module docs); `None`
/// only when there is no candidate. `cands` must hold only routable nodes.
pub fn choose_prefill(
    cands: &[PrefillCandidate],
    keys: &[ChainKey],
    index: &PrefixIndex,
    cfg: &PolicyConfig,
) -> Option<PrefillChoice> {
    debug_assert!(cfg.validate().is_ok(), "invalid policy config {cfg:?}");
    let least = least_loaded(cands)?;
    let choice = |cand: &PrefillCandidate, reason, matched_pages| PrefillChoice {
        node: cand.node,
        reason,
        matched_pages,
        prompt_pages: keys.len(),
    };
    let least_matched = || index.matched(least.node, keys);
    if is_imbalanced(cands, cfg) {
        return Some(choice(least, PrefillReason::Imbalanced, least_matched()));
    }
    if keys.is_empty() {
        return Some(choice(least, PrefillReason::NoPrefix, 0));
    }
    let best = best_match(cands, keys, index)?;
    let ratio = best.matched_pages as f64 / keys.len() as f64;
    if ratio >= cfg.cache_match_ratio {
        Some(choice(
            best.cand,
            PrefillReason::CacheAffinity,
            best.matched_pages,
        ))
    } else {
        Some(choice(least, PrefillReason::LeastLoaded, least_matched()))
    }
}

/// The node with the longest match and how long it is.
#[derive(Debug, Clone, Copy)]
struct BestMatch<'a> {
    cand: &'a PrefillCandidate,
    matched_pages: usize,
}

/// Longest match; ties by lower load, then lower node id.
fn best_match<'a>(
    cands: &'a [PrefillCandidate],
    keys: &[ChainKey],
    index: &PrefixIndex,
) -> Option<BestMatch<'a>> {
    cands
        .iter()
        .map(|cand| BestMatch {
            cand,
            matched_pages: index.matched(cand.node, keys),
        })
        .min_by_key(|m| {
            (
                Reverse(m.matched_pages),
                m.cand.queued_requests,
                m.cand.node,
            )
        })
}

/// Fewest queued requests; ties by more free pages, then lower node id.
fn least_loaded(cands: &[PrefillCandidate]) -> Option<&PrefillCandidate> {
    cands
        .iter()
        .min_by_key(|c| (c.queued_requests, Reverse(c.free_pages), c.node))
}

/// SGLang's imbalance test: an absolute *and* a relative gap between the extremes.
fn is_imbalanced(cands: &[PrefillCandidate], cfg: &PolicyConfig) -> bool {
    let loads = cands.iter().map(|c| c.queued_requests);
    let (Some(max_load), Some(min_load)) = (loads.clone().max(), loads.min()) else {
        return false;
    };
    max_load - min_load > cfg.balance_abs_requests
        && f64::from(max_load) > cfg.balance_rel * f64::from(min_load)
}

/// Why the decode node was chosen, for the audit record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeReason {
    /// The better of two sampled fitting nodes.
    PowerOfTwo,
    /// Exactly one node had room.
    Only,
    /// No node had room. [`choose_decode`] returns `None` then; the async router uses this
    /// variant to name the refusal in its audit record.
    NoneFits,
}

impl DecodeReason {
    /// The stable name the audit record and metrics use.
    pub fn name(self) -> &'static str {
        match self {
            Self::PowerOfTwo => "power_of_two",
            Self::Only => "only",
            Self::NoneFits => "none_fits",
        }
    }
}

/// A decode decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeChoice {
    /// The chosen node.
    pub node: NodeId,
    /// Why.
    pub reason: DecodeReason,
    /// The sampled alternative it was compared with, if there was one.
    pub other: Option<NodeId>,
}

/// Power of two choices on free pages (see the module docs); `None` when no candidate has
/// `need_pages` free.
pub fn choose_decode(
    cands: &[DecodeCandidate],
    need_pages: u32,
    rng: &mut SplitMix64,
) -> Option<DecodeChoice> {
    let fitting = count_fitting(cands, need_pages);
    if fitting == 1 {
        let only = nth_fitting(cands, need_pages, 0)?;
        return Some(DecodeChoice {
            node: only.node,
            reason: DecodeReason::Only,
            other: None,
        });
    }
    let [first, second] = two_distinct_below(fitting, rng)?;
    let a = nth_fitting(cands, need_pages, first)?;
    let b = nth_fitting(cands, need_pages, second)?;
    let (chosen, other) = if decode_rank(a) <= decode_rank(b) {
        (a, b)
    } else {
        (b, a)
    };
    debug_assert!(chosen.free_pages >= need_pages && other.free_pages >= need_pages);
    Some(DecodeChoice {
        node: chosen.node,
        reason: DecodeReason::PowerOfTwo,
        other: Some(other.node),
    })
}

/// The baseline: a uniformly random node among those with `need_pages` free.
pub fn choose_decode_random(
    cands: &[DecodeCandidate],
    need_pages: u32,
    rng: &mut SplitMix64,
) -> Option<NodeId> {
    let fitting = count_fitting(cands, need_pages);
    if fitting == 0 {
        return None;
    }
    let pick = rng.below(fitting as u64) as usize;
    nth_fitting(cands, need_pages, pick).map(|c| c.node)
}

/// Smaller is better: more free pages, then fewer live requests, then lower node id.
fn decode_rank(c: &DecodeCandidate) -> (Reverse<u32>, u32, NodeId) {
    (Reverse(c.free_pages), c.live_requests, c.node)
}

fn count_fitting(cands: &[DecodeCandidate], need_pages: u32) -> usize {
    cands.iter().filter(|c| c.free_pages >= need_pages).count()
}

/// The `n`-th fitting candidate in slice order: sampling by position avoids collecting the
/// fitting ones into a buffer on every decision.
fn nth_fitting(cands: &[DecodeCandidate], need_pages: u32, n: usize) -> Option<&DecodeCandidate> {
    cands.iter().filter(|c| c.free_pages >= need_pages).nth(n)
}

/// Two distinct indices uniform in `0..n`; `None` when `n < 2`.
fn two_distinct_below(n: usize, rng: &mut SplitMix64) -> Option<[usize; 2]> {
    if n < 2 {
        return None;
    }
    let first = rng.below(n as u64) as usize;
    // Uniform over the n − 1 others: skip over `first`.
    let mut second = rng.below(n as u64 - 1) as usize;
    if second >= first {
        second += 1;
    }
    Some([first, second])
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_keys::prompt;

    fn prefill(node: NodeId, queued_requests: u32, free_pages: u32) -> PrefillCandidate {
        PrefillCandidate {
            node,
            queued_requests,
            free_pages,
        }
    }

    fn decode(node: NodeId, free_pages: u32, live_requests: u32) -> DecodeCandidate {
        DecodeCandidate {
            node,
            free_pages,
            live_requests,
        }
    }

    /// Node 1 holds `held` of prompt 7's first pages; node 0 holds nothing.
    fn index_with(held: u8) -> PrefixIndex {
        let mut index = PrefixIndex::new(64);
        index.record(1, &prompt(7, held));
        index
    }

    #[test]
    fn affinity_at_or_above_the_ratio_least_loaded_below() {
        let cfg = PolicyConfig::default();
        let cands = [prefill(0, 0, 10), prefill(1, 3, 10)];
        let keys = prompt(7, 4);
        // (pages node 1 holds, expected node, reason, matched_pages)
        let table = [
            (4, 1, PrefillReason::CacheAffinity, 4),
            (2, 1, PrefillReason::CacheAffinity, 2), // exactly 0.5
            (1, 0, PrefillReason::LeastLoaded, 0),
            (0, 0, PrefillReason::LeastLoaded, 0),
        ];
        for (held, node, reason, matched_pages) in table {
            let got = choose_prefill(&cands, &keys, &index_with(held), &cfg);
            let expected = PrefillChoice {
                node,
                reason,
                matched_pages,
                prompt_pages: 4,
            };
            assert_eq!(got, Some(expected), "node 1 holds {held} pages");
        }
    }

    #[test]
    fn a_stricter_ratio_turns_affinity_into_least_loaded() {
        let cfg = PolicyConfig {
            cache_match_ratio: 1.0,
            ..PolicyConfig::default()
        };
        let cands = [prefill(0, 0, 10), prefill(1, 3, 10)];
        let got = choose_prefill(&cands, &prompt(7, 4), &index_with(3), &cfg);
        assert_eq!(
            got.map(|c| (c.node, c.reason)),
            Some((0, PrefillReason::LeastLoaded))
        );
    }

    #[test]
    fn the_imbalance_guard_overrides_affinity() {
        let cfg = PolicyConfig::default();
        let keys = prompt(7, 4);
        let index = index_with(4);
        // (node 0 load, node 1 load, expected node, reason)
        let table = [
            (0, 9, 0, PrefillReason::Imbalanced),      // gap 9 > 8, 9 > 0
            (0, 8, 1, PrefillReason::CacheAffinity),   // gap 8: not above the absolute bound
            (20, 29, 1, PrefillReason::CacheAffinity), // gap 9, but 29 <= 1.5 × 20
            (20, 31, 0, PrefillReason::Imbalanced),    // gap 11 and 31 > 30
        ];
        for (load0, load1, node, reason) in table {
            let cands = [prefill(0, load0, 10), prefill(1, load1, 10)];
            let got = choose_prefill(&cands, &keys, &index, &cfg);
            assert_eq!(
                got.map(|c| (c.node, c.reason)),
                Some((node, reason)),
                "{load0}/{load1}"
            );
        }
        // The guard reports what the chosen node holds.
        let cands = [prefill(0, 30, 10), prefill(1, 0, 10)];
        let got = choose_prefill(&cands, &keys, &index, &cfg).map(|c| c.matched_pages);
        assert_eq!(got, Some(4));
    }

    #[test]
    fn no_prefix_and_no_candidates() {
        let cfg = PolicyConfig::default();
        let cands = [prefill(0, 2, 10), prefill(1, 1, 10)];
        let got = choose_prefill(&cands, &[], &index_with(4), &cfg);
        assert_eq!(
            got.map(|c| (c.node, c.reason)),
            Some((1, PrefillReason::NoPrefix))
        );
        assert_eq!(
            choose_prefill(&[], &prompt(7, 4), &index_with(4), &cfg),
            None
        );
    }

    #[test]
    fn ties_are_broken_deterministically() {
        let cfg = PolicyConfig::default();
        // Least loaded: equal load, more free pages wins; then lower id.
        let cands = [prefill(5, 1, 10), prefill(3, 1, 20), prefill(4, 1, 20)];
        let got = choose_prefill(&cands, &[], &PrefixIndex::new(1), &cfg).map(|c| c.node);
        assert_eq!(got, Some(3));
        // Affinity: equal match, lower load wins; then lower id.
        let mut index = PrefixIndex::new(64);
        for node in [2, 6, 9] {
            index.record(node, &prompt(7, 4));
        }
        let keys = prompt(7, 4);
        let cands = [
            prefill(9, 2, 0),
            prefill(6, 1, 0),
            prefill(2, 2, 0),
            prefill(0, 0, 0),
        ];
        let got = choose_prefill(&cands, &keys, &index, &cfg).map(|c| (c.node, c.reason));
        assert_eq!(got, Some((6, PrefillReason::CacheAffinity)));
        let cands = [prefill(9, 2, 0), prefill(2, 2, 0), prefill(0, 0, 0)];
        let got = choose_prefill(&cands, &keys, &index, &cfg).map(|c| c.node);
        assert_eq!(got, Some(2));
    }

    #[test]
    fn policy_config_validates() {
        let base = PolicyConfig::default();
        assert_eq!(base.validate(), Ok(()));
        let bad_ratios = [0.0, -0.1, 1.01, f64::NAN];
        for ratio in bad_ratios {
            let cfg = PolicyConfig {
                cache_match_ratio: ratio,
                ..base
            };
            assert!(
                matches!(cfg.validate(), Err(PolicyError::CacheMatchRatio { .. })),
                "{ratio}"
            );
        }
        for rel in [0.99, f64::NAN, f64::INFINITY] {
            let cfg = PolicyConfig {
                balance_rel: rel,
                ..base
            };
            assert!(
                matches!(cfg.validate(), Err(PolicyError::BalanceRel { .. })),
                "{rel}"
            );
        }
        let edge = PolicyConfig {
            cache_match_ratio: 1.0,
            balance_rel: 1.0,
            ..base
        };
        assert_eq!(edge.validate(), Ok(()));
    }

    #[test]
    fn reason_names() {
        let prefill_names = [
            PrefillReason::CacheAffinity,
            PrefillReason::LeastLoaded,
            PrefillReason::Imbalanced,
            PrefillReason::NoPrefix,
        ]
        .map(PrefillReason::name);
        assert_eq!(
            prefill_names,
            ["cache_affinity", "least_loaded", "imbalanced", "no_prefix"]
        );
        let decode_names = [
            DecodeReason::PowerOfTwo,
            DecodeReason::Only,
            DecodeReason::NoneFits,
        ]
        .map(DecodeReason::name);
        assert_eq!(decode_names, ["power_of_two", "only", "none_fits"]);
    }

    /// A mixed fleet: some nodes fit a 50-page request, some do not.
    fn mixed_decode_fleet() -> Vec<DecodeCandidate> {
        (0..12)
            .map(|node| decode(node, node * 37 % 101, node % 3))
            .collect()
    }

    #[test]
    fn p2c_never_picks_a_node_without_room() {
        const NEED: u32 = 50;
        let cands = mixed_decode_fleet();
        let free = |node: NodeId| cands[node as usize].free_pages;
        assert!(
            cands.iter().any(|c| c.free_pages < NEED),
            "the fleet must have misfits"
        );
        let mut rng = SplitMix64::new(11);
        for _ in 0..2000 {
            let choice = choose_decode(&cands, NEED, &mut rng).expect("some fit");
            assert!(free(choice.node) >= NEED);
            assert!(
                choice
                    .other
                    .is_some_and(|o| free(o) >= NEED && o != choice.node)
            );
            let random = choose_decode_random(&cands, NEED, &mut rng).expect("some fit");
            assert!(free(random) >= NEED);
        }
    }

    #[test]
    fn p2c_picks_the_better_of_its_two() {
        let cands = mixed_decode_fleet();
        let by_node = |node: NodeId| &cands[node as usize];
        let mut rng = SplitMix64::new(5);
        let mut strictly_better = 0;
        for _ in 0..2000 {
            let choice = choose_decode(&cands, 0, &mut rng).expect("all fit");
            let (chosen, other) = (by_node(choice.node), by_node(choice.other.expect("two")));
            assert!(
                decode_rank(chosen) < decode_rank(other),
                "{chosen:?} vs {other:?}"
            );
            strictly_better += u32::from(chosen.free_pages > other.free_pages);
        }
        assert!(
            strictly_better > 1000,
            "free pages should decide most draws"
        );
        // Ties on free pages go to fewer live requests, then lower id.
        let tied = [decode(4, 100, 3), decode(2, 100, 1), decode(1, 100, 1)];
        let mut rng = SplitMix64::new(1);
        for _ in 0..200 {
            let choice = choose_decode(&tied[..2], 10, &mut rng).expect("fits");
            assert_eq!(choice.node, 2);
            let choice = choose_decode(&tied[1..], 10, &mut rng).expect("fits");
            assert_eq!(choice.node, 1);
        }
    }

    #[test]
    fn one_fitting_node_is_the_only_choice_and_none_is_none() {
        let cands = [decode(0, 10, 0), decode(1, 60, 5), decode(2, 30, 0)];
        let mut rng = SplitMix64::new(9);
        let only = DecodeChoice {
            node: 1,
            reason: DecodeReason::Only,
            other: None,
        };
        assert_eq!(choose_decode(&cands, 50, &mut rng), Some(only));
        assert_eq!(choose_decode(&cands, 61, &mut rng), None);
        assert_eq!(choose_decode(&[], 0, &mut rng), None);
        assert_eq!(choose_decode_random(&cands, 61, &mut rng), None);
        assert_eq!(choose_decode_random(&cands, 50, &mut rng), Some(1));
    }

    #[test]
    fn decode_choices_are_determined_by_the_seed() {
        let cands: Vec<_> = (0..16).map(|node| decode(node, 100, 0)).collect();
        let draws = |seed| {
            let mut rng = SplitMix64::new(seed);
            (0..64)
                .map(|_| choose_decode(&cands, 1, &mut rng).map(|c| (c.node, c.other)))
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(17), draws(17));
        assert_ne!(draws(17), draws(18));
    }

    #[test]
    fn both_samplers_cover_every_fitting_node() {
        let cands = mixed_decode_fleet();
        let fitting: Vec<_> = cands
            .iter()
            .filter(|c| c.free_pages >= 50)
            .map(|c| c.node)
            .collect();
        let mut rng = SplitMix64::new(23);
        let mut sampled = vec![0u32; cands.len()];
        let mut random = vec![0u32; cands.len()];
        for _ in 0..6000 {
            let choice = choose_decode(&cands, 50, &mut rng).expect("fits");
            sampled[choice.node as usize] += 1;
            sampled[choice.other.expect("two") as usize] += 1;
            random[choose_decode_random(&cands, 50, &mut rng).expect("fits") as usize] += 1;
        }
        let expected_random = 6000 / fitting.len() as u32;
        for node in fitting {
            // Each fitting node is sampled 2/k of the time; the baseline picks it 1/k.
            assert!(
                sampled[node as usize] > 2 * expected_random * 8 / 10,
                "node {node}"
            );
            assert!(random[node as usize].abs_diff(expected_random) < expected_random / 5);
        }
    }
}

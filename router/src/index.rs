//! The router's approximate record of what each prefill node has cached.
//!
//! SGLang's cache-aware router keeps an approximate radix tree of the prompts it sent where,
//! rather than asking the workers: asking would put a round trip on every decision. Custody's
//! prompts arrive already cut into [`ChainKey`]s, one per full page, each hashing the one before
//! it, so a prefix *is* a sequence of keys and the tree collapses into a set of keys per node: a
//! node "has" `keys[..n]` when it has every one of them.
//!
//! The record is approximate in the same way SGLang's is: it assumes a node keeps what it was
//! sent, and forgets it in least-recently-used order once the node's capacity is reached. The
//! node's real cache may evict in a different order; the router learns of a lost cache only when
//! the node restarts ([`PrefixIndex::forget_node`]).
//!
//! Bounded: at most `capacity_keys_per_node` keys per node, so memory is
//! O(nodes × capacity) whatever the traffic.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::{ChainKey, NodeId};

/// One node's keys, each with its last-use tick, and the same keys ordered by that tick.
#[derive(Debug, Clone, Default)]
struct NodeCache {
    last_use: HashMap<ChainKey, u64>,
    /// `(tick, key)` for every key in `last_use`: the first entry is the least recently used.
    by_age: BTreeSet<(u64, ChainKey)>,
}

impl NodeCache {
    fn touch(&mut self, key: ChainKey, tick: u64) {
        if let Some(old_tick) = self.last_use.insert(key, tick) {
            self.by_age.remove(&(old_tick, key));
        }
        self.by_age.insert((tick, key));
    }

    /// Drops least recently used keys until at most `capacity` remain.
    fn evict_beyond(&mut self, capacity: usize) {
        let excess = self.last_use.len().saturating_sub(capacity);
        for _ in 0..excess {
            let Some((_, key)) = self.by_age.pop_first() else {
                break;
            };
            self.last_use.remove(&key);
        }
        debug_assert_eq!(self.last_use.len(), self.by_age.len());
        debug_assert!(self.last_use.len() <= capacity);
    }
}

/// Per prefill node, the chain keys the router believes it holds, LRU-bounded.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    capacity_keys_per_node: usize,
    nodes: BTreeMap<NodeId, NodeCache>,
    /// A logical clock: bumped once per key recorded, so ages are strictly ordered.
    tick: u64,
}

impl PrefixIndex {
    /// An empty index that keeps at most `capacity_keys_per_node` keys for any one node.
    ///
    /// # Panics
    /// If the capacity is 0: an index that can hold nothing would route blind.
    pub fn new(capacity_keys_per_node: usize) -> Self {
        assert!(
            capacity_keys_per_node > 0,
            "PrefixIndex capacity must be > 0"
        );
        Self {
            capacity_keys_per_node,
            nodes: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Records that `node` was sent a prompt with these keys and will hold them: they become its
    /// most recently used, and its least recently used keys beyond capacity are forgotten.
    ///
    /// Keys are touched last to first, so a prompt's first page is its most recent key. Why: a
    /// radix tree evicts leaves before their parents, and a key is useless without the keys
    /// before it, so eviction must eat prefixes from the tail. A prompt longer than the capacity
    /// therefore keeps its first `capacity` pages.
    pub fn record(&mut self, node: NodeId, keys: &[ChainKey]) {
        let cache = self.nodes.entry(node).or_default();
        for key in keys.iter().rev() {
            self.tick += 1;
            cache.touch(*key, self.tick);
        }
        cache.evict_beyond(self.capacity_keys_per_node);
    }

    /// The length of the longest prefix `keys[..n]` that `node` holds entirely.
    pub fn matched(&self, node: NodeId, keys: &[ChainKey]) -> usize {
        let Some(cache) = self.nodes.get(&node) else {
            return 0;
        };
        keys.iter()
            .take_while(|key| cache.last_use.contains_key(*key))
            .count()
    }

    /// Forgets everything about `node`: it restarted or failed, and its cache is gone.
    pub fn forget_node(&mut self, node: NodeId) {
        self.nodes.remove(&node);
    }

    /// How many keys the index holds for `node` (at most the capacity).
    pub fn len(&self, node: NodeId) -> usize {
        self.nodes
            .get(&node)
            .map_or(0, |cache| cache.last_use.len())
    }

    /// Whether the index holds nothing for `node`.
    pub fn is_empty(&self, node: NodeId) -> bool {
        self.len(node) == 0
    }

    /// The per-node bound given to [`PrefixIndex::new`].
    pub fn capacity_keys_per_node(&self) -> usize {
        self.capacity_keys_per_node
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_keys::{key, prompt};

    #[test]
    fn matched_is_the_longest_fully_held_prefix() {
        let mut index = PrefixIndex::new(64);
        index.record(1, &prompt(7, 4));
        assert_eq!(index.matched(1, &prompt(7, 4)), 4);
        assert_eq!(
            index.matched(1, &prompt(7, 6)),
            4,
            "longer prompt, same prefix"
        );
        assert_eq!(index.matched(1, &prompt(7, 2)), 2);
        assert_eq!(index.matched(1, &prompt(8, 4)), 0, "other prompt");
        assert_eq!(index.matched(2, &prompt(7, 4)), 0, "other node");
        assert_eq!(index.matched(1, &[]), 0);
        // A hole stops the match even if later keys are held.
        let holed = [key(7, 0), key(9, 9), key(7, 2)];
        assert_eq!(index.matched(1, &holed), 1);
    }

    #[test]
    fn the_bound_holds_under_any_traffic() {
        const CAPACITY: usize = 10;
        let mut index = PrefixIndex::new(CAPACITY);
        for id in 0..50u8 {
            index.record(3, &prompt(id, id % 7 + 1));
            assert!(
                index.len(3) <= CAPACITY,
                "after prompt {id}: {}",
                index.len(3)
            );
        }
        assert_eq!(index.len(3), CAPACITY);
        assert_eq!(index.capacity_keys_per_node(), CAPACITY);
    }

    #[test]
    fn least_recently_used_prompt_is_evicted_first() {
        let mut index = PrefixIndex::new(6);
        index.record(0, &prompt(1, 3)); // A
        index.record(0, &prompt(2, 3)); // B
        index.record(0, &prompt(1, 3)); // A again: now B is the oldest
        index.record(0, &prompt(3, 3)); // C evicts B, not A
        assert_eq!(index.matched(0, &prompt(1, 3)), 3);
        assert_eq!(index.matched(0, &prompt(2, 3)), 0);
        assert_eq!(index.matched(0, &prompt(3, 3)), 3);
    }

    #[test]
    fn eviction_eats_prefixes_from_the_tail() {
        let mut index = PrefixIndex::new(5);
        index.record(0, &prompt(1, 4));
        index.record(0, &prompt(2, 2)); // one key over: A's last page goes, its head stays
        assert_eq!(index.matched(0, &prompt(1, 4)), 3);
        // A prompt longer than the capacity keeps its first pages.
        index.record(0, &prompt(9, 8));
        assert_eq!(index.matched(0, &prompt(9, 8)), 5);
        assert_eq!(index.matched(0, &prompt(1, 4)), 0);
    }

    #[test]
    fn nodes_are_bounded_independently_and_forgotten_wholly() {
        let mut index = PrefixIndex::new(4);
        index.record(0, &prompt(1, 4));
        index.record(1, &prompt(2, 4));
        index.record(1, &prompt(3, 4));
        assert_eq!(
            index.matched(0, &prompt(1, 4)),
            4,
            "node 1's traffic evicts only node 1"
        );
        index.forget_node(0);
        assert_eq!(index.matched(0, &prompt(1, 4)), 0);
        assert!(index.is_empty(0));
        assert_eq!(index.len(1), 4);
    }

    #[test]
    #[should_panic(expected = "capacity must be > 0")]
    fn zero_capacity_is_refused() {
        let _ = PrefixIndex::new(0);
    }
}

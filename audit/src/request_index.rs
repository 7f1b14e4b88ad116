//! The writer's bounded index of the leaves of recent requests' records (issue 40): what a
//! response's receipt promise lists. Filled as rows are flushed (the leaves are hashed then,
//! once: the seal takes them from here), taken once by the request's response.
//!
//! Bounded by [`RequestIndex::cap_leaves`]: when full, the entries of requests that ended
//! longest ago go first (a response that never asked for its promise loses nothing else); when
//! every entry is still running, new rows of a request are not indexed and its entry is marked
//! incomplete — a promise is never issued for part of a request.

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::tlog::Hash;

/// One record of a request: where it sits in the node's tree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeafRef {
    pub seq: u64,
    /// Its table's name.
    pub table: &'static str,
    pub leaf: Hash,
}

/// What the index holds of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestLeaves {
    /// Every record of the request so far, by seq; `ended`: its end record is among them.
    Found { leaves: Vec<LeafRef>, ended: bool },
    /// Some of its rows were not indexed (the index was full of running requests).
    Incomplete,
    /// Nothing of it (never seen, or evicted, or already taken).
    Unknown,
}

#[derive(Debug, Default)]
struct Entry {
    leaves: Vec<LeafRef>,
    ended: bool,
    incomplete: bool,
}

/// Request id → its records' leaves, for requests of this writer's incarnation.
#[derive(Debug)]
pub struct RequestIndex {
    entries: HashMap<u64, Entry>,
    /// Ended requests, oldest end first (may name entries already taken).
    ended: VecDeque<u64>,
    leaves: usize,
    cap_leaves: usize,
}

impl RequestIndex {
    pub fn new(cap_leaves: usize) -> Self {
        assert!(cap_leaves > 0);
        Self {
            entries: HashMap::new(),
            ended: VecDeque::new(),
            leaves: 0,
            cap_leaves,
        }
    }

    pub fn cap_leaves(&self) -> usize {
        self.cap_leaves
    }

    /// Leaves held now.
    pub fn len_leaves(&self) -> usize {
        self.leaves
    }

    /// One record of `request`; `end`: it is the request's end record. Rows come in the order
    /// they are flushed; a request's rows are sorted by seq when taken.
    pub fn add(&mut self, request: u64, leaf: LeafRef, end: bool) {
        while self.leaves >= self.cap_leaves {
            let Some(old) = self.ended.pop_front() else {
                break;
            };
            if old != request
                && let Some(e) = self.entries.remove(&old)
            {
                self.leaves -= e.leaves.len();
            }
        }
        let e = self.entries.entry(request).or_default();
        if self.leaves >= self.cap_leaves {
            // Full of running requests: this one's promise would be partial.
            self.leaves -= e.leaves.len();
            e.leaves = Vec::new();
            e.incomplete = true;
        } else if !e.incomplete {
            e.leaves.push(leaf);
            self.leaves += 1;
        }
        if end && !e.ended {
            e.ended = true;
            self.ended.push_back(request);
        }
        // The ended queue names each entry at most once, plus taken ones not yet popped.
        debug_assert!(self.leaves <= self.cap_leaves);
    }

    /// What the index holds of `request`; an ended request's entry is removed (one promise per
    /// request), a running one's kept.
    pub fn take(&mut self, request: u64) -> RequestLeaves {
        let Some(e) = self.entries.get(&request) else {
            return RequestLeaves::Unknown;
        };
        if e.incomplete {
            if e.ended {
                self.entries.remove(&request);
            }
            return RequestLeaves::Incomplete;
        }
        let (mut leaves, ended) = if e.ended {
            let e = self.entries.remove(&request).unwrap_or_default();
            self.leaves -= e.leaves.len();
            (e.leaves, true)
        } else {
            (e.leaves.clone(), false)
        };
        leaves.sort_unstable_by_key(|l| l.seq);
        RequestLeaves::Found { leaves, ended }
    }

    /// Forgets every request (a new incarnation's ids start again).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.ended.clear();
        self.leaves = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(seq: u64) -> LeafRef {
        LeafRef {
            seq,
            table: "requests",
            leaf: Hash([seq as u8; 32]),
        }
    }

    fn seqs(r: RequestLeaves) -> (Vec<u64>, bool) {
        match r {
            RequestLeaves::Found { leaves, ended } => {
                (leaves.iter().map(|l| l.seq).collect(), ended)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_request_is_taken_whole_by_seq_and_once_ended() {
        let mut ix = RequestIndex::new(16);
        ix.add(1, leaf(5), false);
        ix.add(2, leaf(6), false);
        ix.add(1, leaf(3), false);
        // Running: shown, kept.
        assert_eq!(seqs(ix.take(1)), (vec![3, 5], false));
        ix.add(1, leaf(7), true);
        assert_eq!(seqs(ix.take(1)), (vec![3, 5, 7], true));
        assert_eq!(ix.take(1), RequestLeaves::Unknown);
        assert_eq!(ix.len_leaves(), 1);
        assert_eq!(ix.take(9), RequestLeaves::Unknown);
    }

    #[test]
    fn full_it_forgets_the_oldest_ended_requests_first() {
        let mut ix = RequestIndex::new(4);
        ix.add(1, leaf(0), true);
        ix.add(2, leaf(1), false);
        ix.add(3, leaf(2), true);
        ix.add(2, leaf(3), false);
        // Full: request 1 (ended first) goes, not running request 2.
        ix.add(4, leaf(4), false);
        assert_eq!(ix.take(1), RequestLeaves::Unknown);
        assert_eq!(seqs(ix.take(2)), (vec![1, 3], false));
        // Full again: request 3 (the oldest ended) goes.
        ix.add(2, leaf(5), true);
        assert_eq!(ix.len_leaves(), 4);
        assert_eq!(ix.take(3), RequestLeaves::Unknown);
        assert_eq!(seqs(ix.take(2)), (vec![1, 3, 5], true));
        ix.add(4, leaf(6), true);
        assert_eq!(seqs(ix.take(4)), (vec![4, 6], true));
        assert_eq!(ix.len_leaves(), 0);
    }

    #[test]
    fn full_of_running_requests_a_promise_is_refused_not_partial() {
        let mut ix = RequestIndex::new(2);
        ix.add(1, leaf(0), false);
        ix.add(2, leaf(1), false);
        ix.add(2, leaf(2), true);
        assert_eq!(ix.take(2), RequestLeaves::Incomplete);
        assert!(ix.len_leaves() <= 2);
        assert_eq!(seqs(ix.take(1)), (vec![0], false));
        ix.clear();
        assert_eq!(ix.take(1), RequestLeaves::Unknown);
        assert_eq!(ix.len_leaves(), 0);
    }
}

/// Where each request of this incarnation sits in the log: its first and last record's seq.
/// What a receipt lookup reads instead of scanning back through the log. Bounded by `cap`
/// requests: the lowest ids (the oldest: ids are assigned in order) are forgotten first.
#[derive(Debug)]
pub struct RequestSpans {
    spans: BTreeMap<u64, Span>,
    cap: usize,
    /// Every id below this may have been evicted.
    forgotten_below: u64,
}

/// A request's records: seqs `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub first: u64,
    pub last: u64,
}

/// What the spans say of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanLookup {
    Found(Span),
    /// No record of it in this incarnation (an id above every one seen, or one never used).
    Unknown,
    /// Possibly evicted (an id below the bound): the caller looks in the log itself.
    Forgotten,
}

impl RequestSpans {
    pub fn new(cap: usize) -> Self {
        assert!(cap > 0);
        Self {
            spans: BTreeMap::new(),
            cap,
            forgotten_below: 0,
        }
    }

    pub fn add(&mut self, request: u64, seq: u64) {
        let s = self.spans.entry(request).or_insert(Span {
            first: seq,
            last: seq,
        });
        s.first = s.first.min(seq);
        s.last = s.last.max(seq);
        while self.spans.len() > self.cap {
            if let Some((id, _)) = self.spans.pop_first() {
                self.forgotten_below = self.forgotten_below.max(id + 1);
            }
        }
    }

    pub fn lookup(&self, request: u64) -> SpanLookup {
        match self.spans.get(&request) {
            Some(s) => SpanLookup::Found(*s),
            None if request < self.forgotten_below => SpanLookup::Forgotten,
            None => SpanLookup::Unknown,
        }
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }
}

#[cfg(test)]
mod span_tests {
    use super::*;

    #[test]
    fn spans_cover_each_request_and_forget_the_oldest_ids_first() {
        let mut s = RequestSpans::new(2);
        s.add(1, 10);
        s.add(2, 11);
        s.add(1, 14);
        assert_eq!(
            s.lookup(1),
            SpanLookup::Found(Span {
                first: 10,
                last: 14
            })
        );
        assert_eq!(s.lookup(3), SpanLookup::Unknown);
        s.add(3, 15);
        assert_eq!(s.len(), 2);
        assert_eq!(s.lookup(1), SpanLookup::Forgotten);
        assert_eq!(s.lookup(0), SpanLookup::Forgotten);
        assert_eq!(
            s.lookup(2),
            SpanLookup::Found(Span {
                first: 11,
                last: 11
            })
        );
        assert_eq!(s.lookup(9), SpanLookup::Unknown);
    }
}

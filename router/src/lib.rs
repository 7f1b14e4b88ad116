//! Custody's routing policy, pure.
//!
//! Custody serves N prefill (P) × M decode (D) nodes behind a router. This crate is the part of
//! that router that *decides*: which prefill node gets a prompt, which decode node receives its
//! KV cache, and whether a worker is fit to be chosen at all. The async router elsewhere drives
//! it (gRPC health probes, retries, the audit record) and feeds it what it observed.
//!
//! What this crate must not know, so that its decisions stay reproducible and testable:
//!
//! - **No network, no async, no clock.** Time arrives as `u64` milliseconds from the caller;
//!   randomness arrives as a seeded [`rng::SplitMix64`]. The same inputs give the same choice.
//! - **No engine.** It never sees tokens, tensors or KV pages, only counts the workers report
//!   (queued requests, free pages, live requests).
//! - **No tenants' keys.** Prompts reach it already cut into opaque 32-byte [`ChainKey`]s
//!   (key *i* hashes key *i − 1* and the *i*-th full page of tokens within the request's
//!   namespace), so the router can match prefixes without learning what they contain or whose
//!   they are.
//!
//! Modules: [`health`] (a worker's health state machine and circuit breaker), [`index`] (the
//! router's bounded, approximate record of what each prefill node has cached), [`policy`] (the
//! cache-aware prefill choice and the power-of-two-choices decode choice), [`rng`] (the seeded
//! generator the policy samples with) and [`sim`] (a discrete-event simulation that measures the
//! policy at fleet scale by driving exactly the functions above).

pub mod health;
pub mod index;
pub mod policy;
pub mod rng;
pub mod sim;

/// A worker's identity as the router knows it.
pub type NodeId = u32;

/// One page of a prompt, as an opaque chained hash (see the crate docs): equal keys mean an
/// equal prefix up to and including that page, within one namespace.
pub type ChainKey = [u8; 32];

/// Chain keys for the tests: a distinct key per (prompt, page).
#[cfg(test)]
pub(crate) mod test_keys {
    use crate::ChainKey;

    pub(crate) fn key(prompt: u8, page: u8) -> ChainKey {
        let mut k = [0u8; 32];
        k[0] = prompt;
        k[1] = page;
        k
    }

    pub(crate) fn prompt(id: u8, pages: u8) -> Vec<ChainKey> {
        (0..pages).map(|page| key(id, page)).collect()
    }
}

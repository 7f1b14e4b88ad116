//! The prefill role: prompts only, each one's pages held for its transfer.
//!
//! A [`PrefillEngine`] owns the one set the role adds to the core: `held`, the prefilled
//! sequences whose KV is being written to a decode node. A held sequence is in no core queue, so
//! no step reads or writes its pages; they return to the free list only through
//! [`PrefillEngine::release_held`] (the transfer is over) or an abort.

use custody_audit::{self as audit, RequestKind};
use custody_kernels::attention::PageRef;

use super::{AdmissionError, Engine, Event, GenerateRequest, Goal, RequestId, Seq};
use crate::kv::{GrantError, SendGrant};

/// The engine of a prefill node (see the module docs).
#[derive(Debug)]
pub struct PrefillEngine {
    core: Engine,
    /// Prompts done, pages held until their transfer completes.
    held: Vec<Seq>,
}

impl PrefillEngine {
    /// Take an idle engine for the prefill role.
    ///
    /// # Panics
    /// If `core` already has requests (a role is chosen before any work is admitted).
    pub fn new(core: Engine) -> Self {
        assert_eq!(core.n_live(), 0, "an engine takes its role while idle");
        Self {
            core,
            held: Vec::new(),
        }
    }

    /// The admission check alone for a prefill-only request (nothing recorded or allocated).
    pub fn check(&self, req: &GenerateRequest) -> Result<(), AdmissionError> {
        self.core.check_admission(req, Goal::PrefillOnly)
    }

    /// Admit a request that stops after its prompt (plus the first sampled token,
    /// [`Event::Prefilled`]) and holds its pages for the transfer until
    /// [`PrefillEngine::release_held`]. Its page reservation is the prompt only.
    pub fn submit(&mut self, req: GenerateRequest) -> Result<RequestId, AdmissionError> {
        self.core.submit_as(req, Goal::PrefillOnly)
    }

    /// Pages (block table) and filled slots of a held (prefilled) request.
    pub fn held(&self, id: RequestId) -> Option<(&[PageRef], usize)> {
        self.held
            .iter()
            .find(|s| s.id == id)
            .map(|s| (&s.pages[..], s.n_cached))
    }

    /// The capability to read a held (prefilled) request's prompt pages for its transfer: the
    /// pages holding its `n_cached` written slots, in their current generations. `None` if `id`
    /// is not held; an error if the pool's tags no longer back the grant.
    pub fn send_grant(&self, id: RequestId) -> Option<Result<SendGrant, GrantError>> {
        let s = self.held.iter().find(|s| s.id == id)?;
        Some(self.core.pool.grant_send(&s.reader(), &s.pages, s.n_cached))
    }

    /// The transfer of a held request is over (every write completed or failed): release its
    /// pages and record how it ended. Returns whether it was held.
    pub fn release_held(&mut self, id: RequestId, kind: RequestKind) -> bool {
        let Some(i) = self.held.iter().position(|s| s.id == id) else {
            return false;
        };
        let s = self.held.swap_remove(i);
        self.core.retire(s, kind);
        true
    }

    /// Abort a request, waiting, prefilling or held (recorded `aborted` with `reason`).
    /// Returns whether it existed.
    pub fn abort(&mut self, id: RequestId, reason: &str) -> bool {
        self.core.abort(id, reason)
            || self.release_held(
                id,
                RequestKind::Aborted {
                    reason: reason.into(),
                },
            )
    }

    /// Run one batch; sequences whose prompt completed move to the held set. After an audit
    /// failure every held sequence is aborted too (the core aborts its own).
    pub fn step(&mut self) -> Vec<Event> {
        let out = self.core.step_collect();
        debug_assert!(
            out.prefilled.iter().all(|s| s.goal == Goal::PrefillOnly),
            "only prefill-only sequences are handed over"
        );
        for s in &out.prefilled {
            // The transfer reads host memory: a device backend's pages are staged there first.
            if let Err(e) = self.core.stage_to_host(&s.pages) {
                self.core.device_failed(&e);
                break;
            }
        }
        self.held.extend(out.prefilled);
        let mut events = out.events;
        if self.core.audit_error.is_some() && !self.held.is_empty() {
            let reason = self.core.audit_abort_reason();
            for s in std::mem::take(&mut self.held) {
                events.push(Event::Aborted {
                    id: s.id,
                    reason: reason.clone(),
                });
                self.core.release(&s);
            }
        }
        events
    }

    /// Requests in any state, held ones included (0 = pool fully free).
    pub fn n_live(&self) -> usize {
        self.core.n_live() + self.held.len()
    }

    /// Whether a step has anything to do (held sequences wait for their transfer, not a step).
    pub fn has_work(&self) -> bool {
        self.core.has_work()
    }

    /// Record an event the node observed (its transfers), through the engine's sink.
    pub fn record(&mut self, ev: audit::Event) {
        self.core.record(ev);
    }

    /// The engine core, read-only: its model, pool and limits (queries only — every change
    /// goes through this role's methods).
    pub fn core(&self) -> &Engine {
        &self.core
    }
}

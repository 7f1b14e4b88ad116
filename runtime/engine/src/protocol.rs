//! The disaggregated request protocol as a state machine — shared, verbatim, by the engine's
//! prefill/decode nodes and by the model checker (`tests/tests/e2e/model_check.rs`), so the model
//! that is checked is the machine that runs.
//!
//! This module has no dependencies beyond `core`: it is pure data and transition functions.
//!
//! # Request states (one request, across both nodes)
//! ```text
//!   Received ──reject──> Rejected                       (nothing allocated anywhere)
//!      │ reserve (decode allocates pages, registers a key for them)
//!   Reserved ──start_prefill──> Prefilling ──post_writes──> Transferring
//!                                                            │ all writes completed AND
//!                                                            │ every page's checksum verified
//!                                                         Prefilled ──handoff──> Decoding ──finish──> Finished
//!   abort is allowed from every non-terminal state ──> Aborted
//!   fail (integrity / checksum / transport error)   ──> Failed
//! ```
//! Only `Prefilled` can be handed to decode: there is no other transition into `Decoding`.
//!
//! # Who drives it
//! Both nodes hold a [`ReqMachine`] per request (its state is private to this module) and change
//! it only through [`ReqMachine::on`]; an illegal transition fails the request (`requests` row
//! `failed`, reason = the [`IllegalTransition`]), it is never ignored. The prefill node computes
//! the prompt into its *own* pool before it asks decode for pages, which touches no decode page
//! and is outside this machine; its machine goes `Reserve`, `StartPrefill` when decode's
//! reservation arrives, `PostWrites` when it posts, `AllVerified` when every write completed.
//! The decode node's machine goes `Reserve` when it allocates, [`ReqMachine::observe_posted`]
//! when the first write lands, `AllVerified` when every prompt page verified, `Handoff` at
//! commit. The model checker (`tests/tests/e2e/model_check.rs`) drives the same `ReqMachine`.
//!
//! # Decode page states
//! ```text
//!   Free ──reserve──> Reserved(key) ──verified──> Filled
//!   Reserved/Filled ──request ends──> Quarantined(key)   (a write of `key` may still land)
//!   Quarantined ──key invalidated (no write can land any more)──> Free
//! ```
//! A page leaves `Quarantined` only when the transport proves that no write of its key can land
//! (`KeyState::Invalidated`), never on a timeout — safety property 2, "no early reuse". In the
//! engine the proof is a value: `DecodeEngine::release_quarantined` takes the
//! `transport::KeyInvalidated` that only a transport's `invalidate` can construct, and admits
//! the release through [`release_allowed`].

/// Where one request is in the disaggregated protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReqState {
    /// Arrived at the front door; nothing allocated.
    Received,
    /// Refused at admission (terminal). No page was allocated and no transfer posted.
    Rejected,
    /// Decode allocated the pages for `prompt + max_tokens` and registered a key for them.
    Reserved,
    /// Prefill is computing the prompt's KV in its own pool.
    Prefilling,
    /// Writes of the prompt's KV into the decode pages are posted; some may be in flight.
    Transferring,
    /// Every write completed and every page verified (in-band tag + checksum) on decode.
    Prefilled,
    /// Decode is generating.
    Decoding,
    /// Terminal: generation ended normally.
    Finished,
    /// Terminal: aborted (client, lost connection, killed peer) before finishing.
    Aborted,
    /// Terminal: an integrity, checksum or transport error ended it without output.
    Failed,
}

/// What can happen to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReqEvent {
    Reject,
    Reserve,
    StartPrefill,
    PostWrites,
    /// All writes completed and decode verified every page.
    AllVerified,
    Handoff,
    Finish,
    Abort,
    Fail,
}

/// A transition the protocol does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IllegalTransition {
    pub from: ReqState,
    pub event: ReqEvent,
}

impl core::fmt::Display for IllegalTransition {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "illegal protocol transition: {:?} on {:?}",
            self.from, self.event
        )
    }
}

impl std::error::Error for IllegalTransition {}

impl ReqState {
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            ReqState::Rejected | ReqState::Finished | ReqState::Aborted | ReqState::Failed
        )
    }

    /// The one transition function. Everything not listed is illegal. Private: a state moves
    /// only inside a [`ReqMachine`] (see its docs for the doors this shuts).
    const fn next(self, event: ReqEvent) -> Result<ReqState, IllegalTransition> {
        use ReqEvent as E;
        use ReqState as S;
        let next = match (self, event) {
            (S::Received, E::Reject) => S::Rejected,
            (S::Received, E::Reserve) => S::Reserved,
            (S::Reserved, E::StartPrefill) => S::Prefilling,
            (S::Prefilling, E::PostWrites) => S::Transferring,
            (S::Transferring, E::AllVerified) => S::Prefilled,
            (S::Prefilled, E::Handoff) => S::Decoding,
            (S::Decoding, E::Finish) => S::Finished,
            (s, E::Abort) if !s.is_terminal() => S::Aborted,
            (s, E::Fail) if !s.is_terminal() && !matches!(s, S::Received) => S::Failed,
            (from, event) => return Err(IllegalTransition { from, event }),
        };
        Ok(next)
    }

    /// Whether the decode node may attend over the request's pages in this state.
    pub const fn may_read(self) -> bool {
        matches!(self, ReqState::Decoding)
    }
}

/// One request's place in the protocol, as a node holds it. The state is private to this
/// module: a node (or the model checker) changes it only through [`ReqMachine::on`] and the
/// methods built on it, which refuse every edge the protocol does not have with a typed
/// [`IllegalTransition`]. There is no way to build a machine in any state but `Received` other
/// than by a sequence of legal events — so the machine the nodes run is the machine that
/// `tests/tests/e2e/model_check.rs` checks.
///
/// Not `Copy`: a node cannot step a copy and keep the original by accident. (It is `Clone`
/// because the model checker's states are cloned; a clone is a second record, and nothing a
/// node does with one changes the record it holds.) The doors this shuts, each checked by the
/// compiler:
///
/// A state is not moved by hand — the transition function is private:
/// ```compile_fail
/// use custody_engine::protocol::{ReqEvent, ReqState};
/// let _ = ReqState::Received.next(ReqEvent::Reserve);
/// ```
/// ```compile_fail
/// use custody_engine::protocol::{ReqEvent, ReqState};
/// let _ = ReqState::Received.on(ReqEvent::Reserve);
/// ```
/// A machine is not built in a chosen state:
/// ```compile_fail
/// use custody_engine::protocol::{ReqMachine, ReqState};
/// let m = ReqMachine { state: ReqState::Prefilled };
/// ```
/// A machine is not copied implicitly (stepping a copy would leave the record behind):
/// ```compile_fail
/// use custody_engine::protocol::{ReqEvent, ReqMachine};
/// let mut m = ReqMachine::new();
/// let mut copy = m;
/// copy.on(ReqEvent::Reserve).unwrap();
/// assert_eq!(m.state(), copy.state());
/// ```
/// A transition's result is not dropped silently (`#[must_use]`; the workspace denies
/// `unused_must_use`):
/// ```compile_fail
/// #![deny(unused_must_use)]
/// use custody_engine::protocol::{ReqEvent, ReqMachine};
/// let mut m = ReqMachine::new();
/// m.on(ReqEvent::Reserve);
/// ```
/// What the nodes do instead (the control: this compiles and runs):
/// ```
/// use custody_engine::protocol::{ReqEvent, ReqMachine, ReqState};
/// let mut m = ReqMachine::new();
/// assert!(m.allows(ReqEvent::Reserve));
/// assert_eq!(m.on(ReqEvent::Reserve), Ok(ReqState::Reserved));
/// assert!(m.on(ReqEvent::Handoff).is_err());
/// assert_eq!(m.state(), ReqState::Reserved);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReqMachine {
    state: ReqState,
}

impl Default for ReqMachine {
    fn default() -> Self {
        Self::new()
    }
}

impl ReqMachine {
    /// A request that just arrived: nothing allocated.
    pub const fn new() -> Self {
        Self {
            state: ReqState::Received,
        }
    }

    pub const fn state(&self) -> ReqState {
        self.state
    }

    /// Apply `event`. On an illegal transition the state is left as it was and the error says
    /// which edge was asked for; the caller must fail the request (never ignore the error).
    #[must_use = "an illegal transition must fail the request"]
    pub fn on(&mut self, event: ReqEvent) -> Result<ReqState, IllegalTransition> {
        let next = self.state.next(event)?;
        self.state = next;
        Ok(next)
    }

    /// Hand a `Prefilled` request to decode (`Handoff`): the returned [`HandedOff`] is the only
    /// value the decode engine's activation accepts, so no request reaches decoding but through
    /// this edge of this machine.
    #[must_use = "an illegal transition must fail the request"]
    pub fn handoff(&mut self) -> Result<HandedOff, IllegalTransition> {
        self.on(ReqEvent::Handoff)?;
        debug_assert_eq!(self.state, ReqState::Decoding);
        Ok(HandedOff { _private: () })
    }

    /// Whether `event` is a legal edge from the current state (nothing changes).
    pub const fn allows(&self, event: ReqEvent) -> bool {
        self.state.next(event).is_ok()
    }

    /// Apply several events in order, stopping at the first illegal one.
    #[must_use = "an illegal transition must fail the request"]
    pub fn on_all(&mut self, events: &[ReqEvent]) -> Result<ReqState, IllegalTransition> {
        for &e in events {
            self.on(e)?;
        }
        Ok(self.state)
    }

    /// The decode node's view of prefill's progress: the first write that lands proves that
    /// prefill started and posted (`StartPrefill`, `PostWrites`), which decode cannot observe
    /// otherwise. A no-op once the request is `Transferring`; illegal from any other state.
    #[must_use = "an illegal transition must fail the request"]
    pub fn observe_posted(&mut self) -> Result<ReqState, IllegalTransition> {
        match self.state {
            ReqState::Transferring => Ok(self.state),
            _ => self.on_all(&[ReqEvent::StartPrefill, ReqEvent::PostWrites]),
        }
    }

    /// End the request with `event` (`Finish`, `Abort` or `Fail`). If that edge is illegal the
    /// request is failed instead when it can be (the error is returned for the record); a
    /// terminal request stays as it is.
    #[must_use = "the illegal edge, if any, belongs in the request's record"]
    pub fn end(&mut self, event: ReqEvent) -> Result<ReqState, IllegalTransition> {
        debug_assert!(matches!(
            event,
            ReqEvent::Finish | ReqEvent::Abort | ReqEvent::Fail
        ));
        match self.on(event) {
            Ok(s) => Ok(s),
            Err(e) => {
                // The asked edge was illegal: fail the request if it can fail, else abort it;
                // a terminal request refuses both and stays as it is (which is the point).
                if !self.state.is_terminal() {
                    let fallback = if self.allows(ReqEvent::Fail) {
                        ReqEvent::Fail
                    } else {
                        ReqEvent::Abort
                    };
                    self.state = match self.state.next(fallback) {
                        Ok(s) => s,
                        Err(_) => unreachable!("a non-terminal state can fail or abort"),
                    };
                }
                Err(e)
            }
        }
    }

    /// Fail the request: `Fail` where that edge exists, else `Abort` (a request never admitted
    /// cannot fail, only be aborted); a terminal request stays as it is. Infallible by design —
    /// every non-terminal state has one of the two edges — so there is no result to drop.
    pub fn fail(&mut self) -> ReqState {
        if let Err(e) = self.end(ReqEvent::Fail) {
            debug_assert!(
                self.state.is_terminal(),
                "end() falls back to a terminal state after {e}"
            );
        }
        self.state
    }

    pub const fn is_terminal(&self) -> bool {
        self.state.is_terminal()
    }

    /// Whether the decode node may attend over the request's pages now.
    pub const fn may_read(&self) -> bool {
        self.state.may_read()
    }
}

/// Proof that a request's machine took the `Handoff` edge (`Prefilled` → `Decoding`): only
/// [`ReqMachine::handoff`] makes one (its field is private), and the decode engine's activation
/// takes it by value.
/// ```compile_fail
/// let forged = custody_engine::protocol::HandedOff { _private: () };
/// ```
#[derive(Debug)]
pub struct HandedOff {
    _private: (),
}

/// Whether writes carrying a region key can still land.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeyState {
    /// Registered: a write with this key lands if it is in range.
    Valid,
    /// Invalidated (flushed): the transport guarantees no write with this key lands any more.
    Invalidated,
}

/// The life of one decode page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PageState {
    Free,
    /// Allocated to a request; writes of its key may land.
    Reserved,
    /// Transfer landed and verified (or written locally by decode).
    Filled,
    /// The owning request ended while a write of its key may still land.
    Quarantined,
}

/// Safety property 2 as a rule: a page may return to the free list only when no writer can still
/// write it, i.e. its key is invalidated (or it never had one).
pub const fn release_allowed(key: Option<KeyState>) -> bool {
    matches!(key, None | Some(KeyState::Invalidated))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_STATES: [ReqState; 10] = [
        ReqState::Received,
        ReqState::Rejected,
        ReqState::Reserved,
        ReqState::Prefilling,
        ReqState::Transferring,
        ReqState::Prefilled,
        ReqState::Decoding,
        ReqState::Finished,
        ReqState::Aborted,
        ReqState::Failed,
    ];

    #[test]
    fn only_prefilled_reaches_decoding() {
        for s in ALL_STATES {
            for e in [
                ReqEvent::Reject,
                ReqEvent::Reserve,
                ReqEvent::StartPrefill,
                ReqEvent::PostWrites,
                ReqEvent::AllVerified,
                ReqEvent::Handoff,
                ReqEvent::Finish,
                ReqEvent::Abort,
                ReqEvent::Fail,
            ] {
                if let Ok(ReqState::Decoding) = s.next(e) {
                    assert_eq!((s, e), (ReqState::Prefilled, ReqEvent::Handoff));
                }
                if s.is_terminal() {
                    assert!(s.next(e).is_err(), "{s:?} is terminal");
                }
            }
        }
    }

    #[test]
    fn rejected_cannot_be_handed_off() {
        let s = ReqState::Received.next(ReqEvent::Reject).expect("reject");
        assert!(s.next(ReqEvent::Handoff).is_err());
        assert!(s.next(ReqEvent::Reserve).is_err());
    }

    #[test]
    fn machine_refuses_illegal_edges_and_keeps_its_state() {
        let mut m = ReqMachine::new();
        assert_eq!(m.on(ReqEvent::Reserve), Ok(ReqState::Reserved));
        let e = m
            .on(ReqEvent::Handoff)
            .expect_err("Reserved cannot be handed off");
        assert_eq!((e.from, e.event), (ReqState::Reserved, ReqEvent::Handoff));
        assert_eq!(m.state(), ReqState::Reserved);
        assert_eq!(m.observe_posted(), Ok(ReqState::Transferring));
        assert_eq!(m.observe_posted(), Ok(ReqState::Transferring));
        assert!(
            m.end(ReqEvent::Finish).is_err(),
            "Transferring cannot finish"
        );
        assert_eq!(m.state(), ReqState::Failed);
        assert!(m.end(ReqEvent::Abort).is_err());
        assert_eq!(m.state(), ReqState::Failed, "terminal stays terminal");
    }

    #[test]
    fn quarantine_needs_invalidation() {
        assert!(!release_allowed(Some(KeyState::Valid)));
        assert!(release_allowed(Some(KeyState::Invalidated)));
    }
}

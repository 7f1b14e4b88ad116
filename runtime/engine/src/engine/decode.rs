//! The decode role: reservations a remote prefill node writes into, and their quarantine.
//!
//! A [`DecodeEngine`] owns the two sets the role adds to the core, and with them every transfer
//! key the engine knows:
//! - `importing`: reserved requests whose prompt KV is landing (pages allocated, key bound);
//! - `quarantined`: ended requests whose pages a remote writer may still write.
//!
//! A sequence leaves these sets for the core only with the transport's proof that its key is
//! dead ([`KeyInvalidated`], which only a transport's `invalidate` can construct):
//! [`DecodeEngine::activate_import`] requires one, and [`DecodeEngine::release_quarantined`]
//! frees pages only when [`release_allowed`] — the protocol's rule, the one the model checker
//! checks — admits the key's state. Core sequences carry no key at all, so the core cannot
//! release a page a transfer may still write (safety property 2, "no early reuse").

use std::collections::BTreeMap;

use custody_audit::{self as audit, PageKind, RequestKind};
use custody_transport::KeyInvalidated;

use super::{AdmissionError, Engine, Event, GenerateRequest, Goal, Phase, RequestId, Seq, now_ns};
use crate::kv::{LandGrant, Landing, VerifyError};
use crate::protocol::{HandedOff, KeyState, release_allowed};

/// Why an imported (disaggregated) request cannot start decoding.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    #[error("request {0} is not awaiting its KV transfer")]
    Unknown(RequestId),
    #[error("request {id}: page {idx} of {need} has not been verified")]
    Incomplete {
        id: RequestId,
        idx: usize,
        need: usize,
    },
    #[error(transparent)]
    Verify(#[from] VerifyError),
    #[error("request {id}: the invalidated key {proved:#x} is not its transfer key {bound:?}")]
    WrongKey {
        id: RequestId,
        proved: u32,
        bound: Option<u32>,
    },
    #[error("request {id}: its pages could not be staged to the CUDA device: {why}")]
    Device { id: RequestId, why: String },
    #[error("request {id}: its output constraint refuses the first token prefill sampled: {why}")]
    Constraint { id: RequestId, why: String },
}

/// Why quarantined pages were not released (they stay quarantined: the safe direction).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReleaseRefused {
    #[error("request {0} has no quarantined pages")]
    NotQuarantined(RequestId),
    #[error(
        "request {id}: its transfer key {rkey:#x} is not proven invalidated; a write may still land"
    )]
    KeyStillValid { id: RequestId, rkey: u32 },
}

/// The transfer key of a request's pages, as the decode engine knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ImportKey {
    /// No key was ever registered for the pages: no remote writer exists.
    None,
    /// Registered: writes under `rkey` may land.
    Valid(u32),
    /// A [`KeyInvalidated`] for `rkey` was presented: no write of it can land any more.
    Invalidated(u32),
}

impl ImportKey {
    fn state(self) -> Option<KeyState> {
        match self {
            ImportKey::None => None,
            ImportKey::Valid(_) => Some(KeyState::Valid),
            ImportKey::Invalidated(_) => Some(KeyState::Invalidated),
        }
    }

    /// Record `proof` if it is this key's; an error names the mismatch.
    fn invalidate(&mut self, proof: &KeyInvalidated) -> Result<(), u32> {
        match *self {
            ImportKey::Valid(k) | ImportKey::Invalidated(k) if k == proof.rkey() => {
                *self = ImportKey::Invalidated(k);
                Ok(())
            }
            _ => Err(proof.rkey()),
        }
    }

    fn rkey(self) -> Option<u32> {
        match self {
            ImportKey::None => None,
            ImportKey::Valid(k) | ImportKey::Invalidated(k) => Some(k),
        }
    }
}

/// A reservation whose prompt KV is landing.
#[derive(Debug)]
struct Import {
    seq: Seq,
    /// Per logical page, slots verified from a transfer (0 = not yet).
    verified_slots: Vec<u32>,
    key: ImportKey,
}

/// An ended request whose pages wait for their key to be proven dead.
#[derive(Debug)]
struct Quarantined {
    seq: Seq,
    key: ImportKey,
}

/// The engine of a decode node (see the module docs).
#[derive(Debug)]
pub struct DecodeEngine {
    core: Engine,
    importing: Vec<Import>,
    quarantined: Vec<Quarantined>,
    /// Decoding (activated) requests' transfer keys, proven dead at activation — kept so that a
    /// decoding request ended early is quarantined with its key's true state. Bounded by the
    /// core's running set (entries leave with their request).
    decoding_keys: BTreeMap<RequestId, u32>,
}

impl DecodeEngine {
    /// Take an idle engine for the decode role.
    ///
    /// # Panics
    /// If `core` already has requests (a role is chosen before any work is admitted).
    pub fn new(core: Engine) -> Self {
        assert_eq!(core.n_live(), 0, "an engine takes its role while idle");
        Self {
            core,
            importing: Vec::new(),
            quarantined: Vec::new(),
            decoding_keys: BTreeMap::new(),
        }
    }

    /// The pool's landing side, for the transport — the engine thread lends it between steps;
    /// nothing reads the pool concurrently. Each landing needs its reservation's [`LandGrant`]
    /// (from [`DecodeEngine::reserve_import`]) and writes only bytes and the per-page landed
    /// header; tags and the written-slot counts move only through `verify_import`.
    pub fn landing(&mut self) -> Landing<'_> {
        self.core.pool.landing()
    }

    /// Admit a request whose prompt KV will arrive by transfer, and allocate its whole
    /// reservation (`prompt + max_tokens`) now — the pages the transfer writes into, named by
    /// the returned [`LandGrant`], the only value a landing in them accepts. Fails fast with
    /// [`AdmissionError::Busy`] when the pages are not free (the caller retries).
    pub fn reserve_import(
        &mut self,
        req: GenerateRequest,
    ) -> Result<(RequestId, LandGrant), AdmissionError> {
        let core = &mut self.core;
        if let Some(e) = &core.audit_error {
            return Err(AdmissionError::AuditUnavailable(e.clone()));
        }
        let checked = core.check_admission(&req, Goal::Generate).and_then(|()| {
            let need = core.pages_for(req.prompt.len() + req.max_tokens);
            if need > core.pool.n_free() {
                Err(AdmissionError::Busy {
                    needed_pages: need,
                    free_pages: core.pool.n_free(),
                })
            } else {
                Ok(need)
            }
        });
        let id = core.next_id;
        core.next_id += 1;
        let need = match checked {
            Ok(need) => need,
            Err(e) => {
                let reason = RequestKind::Rejected {
                    reason: e.to_string(),
                };
                core.emit_request(id, &req.tenant, reason, req.prompt.len(), 0);
                return Err(e);
            }
        };
        core.emit_request(id, &req.tenant, RequestKind::Admitted, req.prompt.len(), 0);
        let mut seq = Seq::new(id, req, Goal::Generate);
        match core.pool.alloc(id, need) {
            Ok(pages) => seq.pages = pages,
            Err(e) => unreachable!("free pages checked above: {e}"),
        }
        seq.reads = vec![None; seq.pages.len()];
        let grant = match core.pool.grant_land(id, &seq.pages) {
            Ok(g) => g,
            Err(e) => unreachable!("pages just allocated to {id}: {e}"),
        };
        core.emit_pages(id, &seq.tenant, grant.pages(), PageKind::Alloc);
        self.importing.push(Import {
            verified_slots: vec![0; seq.pages.len()],
            seq,
            key: ImportKey::None,
        });
        if let Some(e) = &self.core.audit_error {
            return Err(AdmissionError::AuditUnavailable(e.clone()));
        }
        Ok((id, grant))
    }

    fn import_index(&self, id: RequestId) -> Result<usize, ImportError> {
        self.importing
            .iter()
            .position(|im| im.seq.id == id)
            .ok_or(ImportError::Unknown(id))
    }

    /// The transport registered `rkey` for importing request `id`'s pages. From now on the
    /// pages leave this engine only with that key's [`KeyInvalidated`].
    pub fn bind_import_key(&mut self, id: RequestId, rkey: u32) -> Result<(), ImportError> {
        let i = self.import_index(id)?;
        let im = &mut self.importing[i];
        debug_assert_eq!(im.key, ImportKey::None, "one key per reservation");
        im.key = ImportKey::Valid(rkey);
        Ok(())
    }

    /// A transfer into logical page `idx` of importing request `id` landed; verify its in-band
    /// header and (unless disabled) checksum, and only then count its `slots` as written
    /// (recorded as a `write` by `transfer`).
    pub fn verify_import(
        &mut self,
        id: RequestId,
        idx: usize,
        slots: usize,
        check_checksum: bool,
    ) -> Result<(), ImportError> {
        let i = self.import_index(id)?;
        let Some(&pr) = self.importing[i].seq.pages.get(idx) else {
            return Err(ImportError::Incomplete {
                id,
                idx,
                need: self.importing[i].seq.pages.len(),
            });
        };
        let tenant = self.importing[i].seq.tenant.clone();
        let core = &mut self.core;
        if core.sink.is_some() {
            let kind = PageKind::Write {
                slot_start: 0,
                slot_end: slots as u32,
                writer: audit::Writer::Transfer,
            };
            core.emit_pages(id, &tenant, &[pr], kind);
        }
        match core.pool.verify_landed(pr, id, slots, check_checksum) {
            Ok(()) => {
                self.importing[i].verified_slots[idx] = slots as u32;
                Ok(())
            }
            Err(e) => {
                core.emit(audit::Event::IntegrityViolation {
                    ts_ns: now_ns(),
                    request: id,
                    tenant,
                    page: Some(pr.page),
                    generation: Some(pr.generation),
                    kind: "TransferVerify".into(),
                    detail: e.to_string(),
                });
                Err(e.into())
            }
        }
    }

    /// Start decoding an imported request whose prompt KV is verified. Its first token was
    /// sampled by prefill (`first_token`, counted as generated). Unless `require_verified` is
    /// false (the incident reproduction only), every prompt page must have been verified with
    /// exactly the slots the prompt fills.
    ///
    /// `invalidated` proves that the transfer key is dead: nothing can land in pages that decode
    /// is about to read and append to; `handed_off`, that the request's protocol machine took
    /// the `Handoff` edge (only a `Prefilled` request can).
    pub fn activate_import(
        &mut self,
        id: RequestId,
        first_token: u32,
        require_verified: bool,
        invalidated: &KeyInvalidated,
        // Taken by value: one activation per handoff.
        _handed_off: HandedOff,
    ) -> Result<(), ImportError> {
        let i = self.import_index(id)?;
        let im = &mut self.importing[i];
        let bound = im.key.rkey();
        im.key
            .invalidate(invalidated)
            .map_err(|proved| ImportError::WrongKey { id, proved, bound })?;
        let ps = self.core.pool.page_size();
        let prompt_len = im.seq.prompt.len();
        let need = prompt_len.div_ceil(ps);
        if require_verified {
            for idx in 0..need {
                let want = (prompt_len - idx * ps).min(ps) as u32;
                if im.verified_slots[idx] != want {
                    return Err(ImportError::Incomplete { id, idx, need });
                }
            }
        }
        // A device backend reads its own memory: the landed, verified pages go there first.
        let pages = self.importing[i].seq.pages.clone();
        if let Err(e) = self.core.stage_to_device(&pages) {
            return Err(ImportError::Device {
                id,
                why: e.to_string(),
            });
        }
        // The constraint and the penalties start from the token prefill sampled under the same
        // options (checked before the sequence leaves the import set).
        if let Err(e) = self.importing[i].seq.decode.accept(first_token, false) {
            return Err(ImportError::Constraint {
                id,
                why: e.to_string(),
            });
        }
        let im = self.importing.swap_remove(i);
        debug_assert_eq!(im.key.state(), Some(KeyState::Invalidated));
        let mut seq = im.seq;
        seq.n_cached = prompt_len;
        seq.generated = 1;
        seq.phase = Phase::Decode {
            next_input: first_token,
        };
        self.decoding_keys.insert(id, invalidated.rkey());
        self.core.running.push(seq);
        Ok(())
    }

    /// End an importing or decoding request whose pages a remote writer may still write: its
    /// pages go to quarantine (recorded), not to the free list. Recorded as `kind` with
    /// `delivered_tokens` output tokens — what the client received, when the front ended the
    /// request (`None`: every token produced). Returns whether it existed.
    pub fn quarantine(
        &mut self,
        id: RequestId,
        kind: RequestKind,
        delivered_tokens: Option<usize>,
    ) -> bool {
        let (seq, key) = if let Ok(i) = self.import_index(id) {
            let im = self.importing.swap_remove(i);
            (im.seq, im.key)
        } else if let Some(i) = self.core.running.iter().position(|s| s.id == id) {
            let seq = self.core.running.swap_remove(i);
            let key = match self.decoding_keys.remove(&id) {
                Some(rkey) => ImportKey::Invalidated(rkey),
                None => ImportKey::None,
            };
            (seq, key)
        } else {
            return false;
        };
        let pages = seq.pages.clone();
        let tenant = seq.tenant.clone();
        self.core
            .emit_pages(seq.id, &tenant, &pages, PageKind::Quarantine);
        let output_tokens = delivered_tokens.unwrap_or(seq.generated);
        self.core
            .emit_request(seq.id, &tenant, kind, seq.prompt.len(), output_tokens);
        self.quarantined.push(Quarantined { seq, key });
        true
    }

    /// A quarantined request's pages return to the free list — only if [`release_allowed`]
    /// admits its key's state: never registered, already proven invalidated (at handoff), or
    /// proven dead now by `proof`, which only a transport's `invalidate` can construct.
    /// Otherwise the pages stay quarantined and the refusal says why.
    pub fn release_quarantined(
        &mut self,
        id: RequestId,
        proof: Option<&KeyInvalidated>,
    ) -> Result<(), ReleaseRefused> {
        let Some(i) = self.quarantined.iter().position(|q| q.seq.id == id) else {
            return Err(ReleaseRefused::NotQuarantined(id));
        };
        let key = &mut self.quarantined[i].key;
        if let Some(p) = proof
            && key.invalidate(p).is_err()
        {
            tracing::error!(
                request = id,
                proved = p.rkey(),
                "invalidation proof for another key"
            );
        }
        if !release_allowed(key.state()) {
            return Err(ReleaseRefused::KeyStillValid {
                id,
                rkey: key.rkey().unwrap_or_default(),
            });
        }
        let q = self.quarantined.swap_remove(i);
        self.core.flush_reads(&q.seq);
        self.core.release(&q.seq);
        Ok(())
    }

    /// Pages currently quarantined.
    pub fn n_quarantined_pages(&self) -> usize {
        self.quarantined.iter().map(|q| q.seq.pages.len()).sum()
    }

    /// Run one batch over the decoding requests. After an audit failure every importing request
    /// is aborted into quarantine (a transfer may still write its pages); the core aborts its
    /// own.
    pub fn step(&mut self) -> Vec<Event> {
        let out = self.core.step_collect();
        debug_assert!(
            out.prefilled.is_empty(),
            "decode admits no prefill-only request"
        );
        let mut events = out.events;
        for ev in &events {
            if let Event::Finished { id, .. }
            | Event::Failed { id, .. }
            | Event::Aborted { id, .. } = ev
            {
                self.decoding_keys.remove(id);
            }
        }
        if self.core.audit_error.is_some() && !self.importing.is_empty() {
            let reason = self.core.audit_abort_reason();
            for im in std::mem::take(&mut self.importing) {
                events.push(Event::Aborted {
                    id: im.seq.id,
                    reason: reason.clone(),
                });
                self.quarantined.push(Quarantined {
                    seq: im.seq,
                    key: im.key,
                });
            }
        }
        events
    }

    /// Requests in any state, importing and quarantined included (0 = pool fully free).
    pub fn n_live(&self) -> usize {
        self.core.n_live() + self.importing.len() + self.quarantined.len()
    }

    /// Whether a step has anything to do (importing requests wait for bytes, not a step).
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

//! The decode node: reserves pages for prefilled requests, lands and verifies their KV, decodes.
//!
//! One engine thread owns the engine, the pool and the transport's target side; the gRPC
//! handlers talk to it through a bounded command queue. Nothing else touches the pool, so bytes
//! land (in [`KvTransport::poll_recv`]) on the thread that reads them.

use crate::transport::Discard;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::kv::LandGrant;
use custody_audit::{self as audit, RequestKind};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::proto::{self, decode_server};
use super::protocol::{IllegalTransition, ReqEvent, ReqMachine, ReqState};
use super::{MAX_PAGES_PER_REQUEST, MAX_RESERVATIONS, admission_status, check_pair, imm_split};
use crate::actor::{self, ActorLimits, Mailbox, MailboxError};
use crate::engine::{DecodeEngine, Engine, Event, GenerateRequest, RequestId};
use custody_engine::config::UnsafeReproduction;

#[cfg(feature = "fault-injection")]
use crate::transport::FaultInjection;
use crate::transport::{AccessError, KeyInvalidated, KvTransport, TargetStats, TransportKind};

/// Decode node settings.
#[derive(Clone, Debug)]
pub struct DecodeOptions {
    pub node_id: u32,
    /// The constraint compiler over the model's vocabulary (`None`: constrained requests are
    /// refused with a message saying so).
    pub grammars: Option<Arc<custody_engine::grammar::Grammars>>,
    /// KV transport listen address (port 0 = any; `tcp` only).
    pub transport_listen: SocketAddr,
    /// `tcp` or `verbs`.
    pub transport_kind: TransportKind,
    /// TLS on the KV transport's connections (`[disagg] transport_encryption`; the server side).
    pub kv_encryption: crate::transport::KvEncryption,
    /// Verify each transferred page's checksum before marking it written.
    pub checksum: bool,
    /// A reservation that is not committed within this time is aborted (its key invalidated
    /// first, then its pages freed — never freed on the timeout alone).
    pub reservation_lease: Duration,
    /// Already armed by `--unsafe-reproduction` (or default).
    pub unsafe_: UnsafeReproduction,
    pub fingerprint: String,
    /// Keep the prefill node's checkpoints in this node's log and answer with this node's own
    /// (`None`: the exchange is refused, e.g. without an audit writer).
    pub checkpoints: Option<crate::checkpoints::PeerCheckpoints>,
    /// Set by the node's signal handler: new reservations are refused (nothing reserved or
    /// registered: the router retries elsewhere); requests already reserved finish.
    pub drain: super::Drain,
    /// This node's log, for tenants' promises and proofs (`None`: no audit log).
    pub proofs: Option<Arc<dyn crate::proofs::NodeProofs>>,
    /// `[audit] require_cosignatures`: new work refused while the log lacks them.
    pub gate: Option<Arc<dyn crate::proofs::AuditGate>>,
}

/// How prefill (for the front behind it) ended a request: the `requests` row's kind and the
/// output tokens its client received (`None`: every token produced).
#[derive(Debug)]
struct FrontEnd {
    kind: RequestKind,
    delivered_tokens: Option<usize>,
}

impl FrontEnd {
    /// From an `Abort`: `finish_reason` `stop`/`length` is a finish the client saw, empty an
    /// abort with `reason`; anything else is refused.
    fn from_proto(a: &proto::AbortRequest) -> Result<Self, Status> {
        let kind = match a.finish_reason.as_str() {
            "" => RequestKind::Aborted {
                reason: a.reason.clone(),
            },
            "stop" | "length" => RequestKind::Finished {
                reason: a.finish_reason.clone(),
            },
            other => {
                return Err(Status::invalid_argument(format!(
                    "finish_reason {other:?}: want \"stop\", \"length\" or empty (aborted)"
                )));
            }
        };
        Ok(Self {
            kind,
            delivered_tokens: a.delivered_tokens.map(|n| n as usize),
        })
    }
}

type TokenTx = mpsc::Sender<Result<proto::TokenEvent, Status>>;
type TokenRx = mpsc::Receiver<Result<proto::TokenEvent, Status>>;

enum Cmd {
    Handshake(
        proto::NodeInfo,
        oneshot::Sender<Result<proto::NodeInfo, Status>>,
    ),
    /// With its decoding options, checked and compiled by the service (off the engine thread).
    Reserve(
        proto::ReserveRequest,
        Box<crate::engine_decoding::Decoding>,
        oneshot::Sender<Result<proto::ReserveReply, Status>>,
    ),
    /// Hand off; the reply carries the request's token relay.
    Commit(
        proto::CommitRequest,
        oneshot::Sender<Result<TokenRx, Status>>,
    ),
    Abort(u64, FrontEnd, oneshot::Sender<bool>),
    Stats(oneshot::Sender<DecodeStats>),
    #[cfg(feature = "fault-injection")]
    Fault(DecodeFault),
    #[cfg(feature = "test-oracle")]
    Inspect(usize, Vec<u32>, oneshot::Sender<Vec<Vec<u8>>>),
}

/// Fault injection into a running decode node (feature `fault-injection`, tests only).
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeFault {
    /// Flip a byte of the next landed payload (corruption in flight).
    CorruptNextPayload,
    /// Hold back every write of the next reservation's key; deliver them late (after the
    /// request ended and its pages were reallocated) at `ReleaseHeld`.
    HoldNextReservation,
    ReleaseHeld,
}

/// A decode node's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    pub pool_pages: usize,
    pub free_pages: usize,
    pub quarantined_pages: usize,
    pub live_requests: usize,
    pub reservations: usize,
    pub transport: TargetStats,
    pub verified_pages: u64,
    pub verify_failures: u64,
    pub leases_expired: u64,
}

struct DReq {
    /// This node's view of the request in the protocol; changed only through its `on`.
    machine: ReqMachine,
    rkey: u32,
    /// The region's base address (the transport's): page `idx` is at `base + idx * stride`.
    base: u64,
    slot: u32,
    /// The reservation's pages, as the capability that lands transfers in them.
    land: LandGrant,
    prompt_len: usize,
    origin: u64,
    origin_node: u32,
    tenant: Arc<str>,
    verified: Vec<bool>,
    tokens: Option<TokenTx>,
    max_tokens: usize,
    /// Set at handoff: the transport's proof that the key is dead (then the pages are read).
    invalidated: Option<KeyInvalidated>,
    reserved_at: Instant,
}

struct Node {
    engine: DecodeEngine,
    transport: Box<dyn KvTransport>,
    opts: DecodeOptions,
    reqs: HashMap<RequestId, DReq>,
    by_slot: HashMap<u32, RequestId>,
    by_key: HashMap<u32, RequestId>,
    /// Each paired prefill node's live KV pairing (bounded by the transport's pairings).
    pairings: HashMap<u32, u64>,
    free_slots: Vec<u32>,
    next_slot: u32,
    stats: DecodeStats,
    last_reap: Instant,
    #[cfg(feature = "fault-injection")]
    hold_next: bool,
    info: proto::NodeInfo,
    stride: usize,
}

impl Node {
    fn alloc_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.free_slots.pop() {
            return Some(s);
        }
        if self.next_slot < MAX_RESERVATIONS {
            self.next_slot += 1;
            return Some(self.next_slot - 1);
        }
        None
    }

    /// Apply `events` to request `id`'s machine. An illegal transition fails the request
    /// (`requests` row `failed`, the transition as the reason; pages quarantined, released once
    /// the key is proven dead) and is returned as `failed_precondition`.
    fn transition(&mut self, id: RequestId, events: &[ReqEvent]) -> Result<(), Status> {
        let r = self
            .reqs
            .get_mut(&id)
            .ok_or_else(|| Status::not_found(format!("no request {id} on this decode node")))?;
        match r.machine.on_all(events) {
            Ok(_) => Ok(()),
            Err(e) => Err(self.fail_illegal(id, e)),
        }
    }

    /// Fail request `id` on an illegal protocol transition; the status for its caller.
    fn fail_illegal(&mut self, id: RequestId, e: IllegalTransition) -> Status {
        tracing::error!(request = id, error = %e, "illegal protocol transition: request failed");
        let reason = format!("request {id}: {e}");
        self.end(
            id,
            ReqEvent::Fail,
            RequestKind::Failed {
                reason: reason.clone(),
            },
            Some(reason.clone()),
        );
        Status::failed_precondition(reason)
    }

    fn handshake(&mut self, peer: proto::NodeInfo) -> Result<proto::NodeInfo, Status> {
        check_pair(&peer, &self.info).map_err(|e| Status::failed_precondition(e.to_string()))?;
        // A fresh pairing per handshake; the peer's earlier one is withdrawn (its connections
        // close, its keys refuse every write from then on).
        let pairing = self
            .transport
            .pair()
            .map_err(|e| Status::resource_exhausted(format!("KV transport cannot pair: {e}")))?;
        if let Some(old) = self.pairings.insert(peer.node_id, pairing.id()) {
            self.transport.unpair(old);
        }
        // `verbs`: connect our queue pair to the prefill node's (a repeated handshake is a
        // reconnect: the old connection's writes fail). `tcp`: the prefill node dials us.
        self.transport
            .connect_peer(&peer.transport_addr, &pairing)
            .map_err(|e| {
                Status::unavailable(format!("KV transport cannot connect to the peer: {e}"))
            })?;
        tracing::info!(
            peer = peer.node_id,
            transport = self.transport.kind(),
            "prefill node handshake accepted"
        );
        let mut info = self.info.clone();
        info.transport_addr = self.transport.endpoint();
        info.kv_pairing = Some(proto::KvPairing {
            id: pairing.id(),
            secret: pairing.secret().to_vec(),
        });
        Ok(info)
    }

    /// A router's route must name this node, at its current epoch, and the asking prefill node:
    /// a route minted before this node restarted (another epoch) never reserves a page, so no
    /// write of it can land. Refused here, before anything is reserved or registered.
    fn check_route(&self, req: &proto::ReserveRequest) -> Result<(), Status> {
        if self.opts.drain.is_draining() {
            return Err(Status::unavailable("this decode node is draining"));
        }
        let Some(r) = &req.route else {
            return Ok(());
        };
        if r.decode_node != self.opts.node_id || r.prefill_node != req.origin_node {
            return Err(Status::failed_precondition(format!(
                "the route is prefill {} -> decode {}, this is decode {} asked by prefill {}",
                r.prefill_node, r.decode_node, self.opts.node_id, req.origin_node
            )));
        }
        if r.decode_epoch != self.info.epoch {
            return Err(Status::failed_precondition(format!(
                "stale route: it names epoch {} of decode node {}, which is at epoch {}",
                r.decode_epoch, self.opts.node_id, self.info.epoch
            )));
        }
        Ok(())
    }

    fn reserve(
        &mut self,
        req: proto::ReserveRequest,
        decoding: crate::engine_decoding::Decoding,
    ) -> Result<proto::ReserveReply, Status> {
        self.check_route(&req)?;
        let route = req.route;
        let sampling = super::sampling_from_proto(req.sampling.as_ref());
        let prompt_len = req.prompt.len();
        let greq = GenerateRequest {
            decoding,
            prompt: req.prompt,
            max_tokens: req.max_tokens as usize,
            sampling,
            stop_ids: req.stop_ids,
            tenant: req.tenant.clone(),
            cache: None,
        };
        if prompt_len.div_ceil(self.engine.core().pool().page_size()) > MAX_PAGES_PER_REQUEST {
            return Err(Status::invalid_argument(
                "prompt exceeds the transfer's page index",
            ));
        }
        // Regions are registered for the pairing of the prefill node that asks (the service
        // checked the node id against its certificate): only its connections can write them.
        let Some(&pairing) = self.pairings.get(&req.origin_node) else {
            return Err(Status::failed_precondition(format!(
                "no KV pairing with prefill node {}: handshake first",
                req.origin_node
            )));
        };
        let Some(slot) = self.alloc_slot() else {
            return Err(Status::resource_exhausted("too many live reservations"));
        };
        let (id, land) = match self.engine.reserve_import(greq) {
            Ok(x) => x,
            Err(e) => {
                self.free_slots.push(slot);
                return Err(admission_status(&e));
            }
        };
        let len = (land.pages().len() * self.stride) as u64;
        let region = match self.transport.register(len, pairing) {
            Ok(r) => r,
            Err(e) => {
                self.free_slots.push(slot);
                let kind = RequestKind::Aborted {
                    reason: "cannot register the KV region".into(),
                };
                self.engine.quarantine(id, kind, None);
                // Never registered: no writer exists, and the engine knows no key to wait for.
                if let Err(e) = self.engine.release_quarantined(id, None) {
                    tracing::error!(request = id, error = %e, "pages stay quarantined");
                }
                return Err(Status::unavailable(format!(
                    "cannot register KV region: {e}"
                )));
            }
        };
        if let Err(e) = self.engine.bind_import_key(id, region.rkey) {
            return Err(Status::internal(e.to_string()));
        }
        #[cfg(feature = "fault-injection")]
        if self.hold_next {
            self.hold_next = false;
            self
                .transport
                .fault_inject(FaultInjection::HoldKey(region.rkey)).discard("fault injection on a transport without that fault leaves the test's control path");
        }
        let n_pages = land.pages().len();
        let reply_pages = land
            .pages()
            .iter()
            .map(|p| proto::Page {
                page: p.page,
                generation: p.generation,
            })
            .collect();
        let mut machine = ReqMachine::new();
        machine
            .on(ReqEvent::Reserve)
            .map_err(|e| Status::internal(e.to_string()))?;
        self.reqs.insert(
            id,
            DReq {
                machine,
                rkey: region.rkey,
                base: region.base,
                slot,
                land,
                prompt_len,
                origin: req.origin_request,
                origin_node: req.origin_node,
                tenant: req.tenant.into(),
                verified: vec![false; n_pages],
                tokens: None,
                max_tokens: req.max_tokens as usize,
                invalidated: None,
                reserved_at: Instant::now(),
            },
        );
        self.by_slot.insert(slot, id);
        self.by_key.insert(region.rkey, id);
        if let Some(route) = &route {
            self.engine.record(custody_audit::Event::Node {
                ts_ns: custody_audit::mono_now_ns(),
                kind: super::prefill::ROUTE_EVENT.into(),
                detail: super::prefill::route_detail(id, route),
            });
        }
        Ok(proto::ReserveReply {
            request: id,
            rkey: region.rkey,
            base: region.base,
            page_stride: self.stride as u64,
            pages: reply_pages,
            imm_slot: slot,
        })
    }

    /// Land arrived writes; verify each page whose completion arrived. A few writes (about one
    /// page) per poll, so that each page is verified right after it landed, while its bytes are
    /// still in cache; bounded per call so that the batch keeps stepping.
    fn poll_transport(&mut self) -> usize {
        const WRITES_PER_POLL: usize = 4;
        const WRITES_PER_CALL: usize = 1024;
        let mut total = 0;
        let mut wcs = Vec::new();
        while total < WRITES_PER_CALL {
            wcs.clear();
            let n = {
                let (reqs, by_key) = (&self.reqs, &self.by_key);
                let mut mem = super::PoolLanding {
                    landing: self.engine.landing(),
                    stride: self.stride,
                    // Region → its reservation's landing grant.
                    grant_of: |rkey: u32| {
                        by_key
                            .get(&rkey)
                            .and_then(|id| reqs.get(id))
                            .map(|r| &r.land)
                            .ok_or_else(|| {
                                AccessError(format!("key {rkey} maps to no reservation"))
                            })
                    },
                };
                match self
                    .transport
                    .poll_recv(&mut mem, &mut wcs, WRITES_PER_POLL)
                {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::error!(error = %e, "KV transport poll failed");
                        0
                    }
                }
            };
            for wc in &wcs {
                let (slot, idx) = imm_split(wc.imm());
                let Some(&id) = self.by_slot.get(&slot) else {
                    continue;
                };
                self.page_landed(id, idx);
            }
            if n == 0 {
                break;
            }
            total += n;
        }
        total
    }

    fn page_landed(&mut self, id: RequestId, idx: usize) {
        let legacy = self.opts.unsafe_.truncate_overlength;
        let checksum = self.opts.checksum && !self.opts.unsafe_.disable_checksum;
        let ps = self.engine.core().pool().page_size();
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        // Progress renews the lease: only a stalled transfer expires.
        r.reserved_at = Instant::now();
        if idx >= r.land.pages().len() {
            return; // the landing refused it (outside the region): nothing landed
        }
        // A landed page proves that prefill started and posted; after `AllVerified` (or from
        // any state but `Reserved`/`Transferring`) a landing is an illegal transition.
        if let Err(e) = r.machine.observe_posted() {
            // The request is failed and recorded; the landing has no caller to give the status.
            drop(self.fail_illegal(id, e));
            return;
        }
        let n_prompt_pages = r.prompt_len.div_ceil(ps);
        let slots = if legacy {
            // The legacy path believes whatever the header says.
            self.engine
                .core()
                .pool()
                .landed_slots(r.land.pages()[idx].page) as usize
        } else if idx < n_prompt_pages {
            (r.prompt_len - idx * ps).min(ps)
        } else {
            usize::MAX // a write beyond the prompt: refused below
        };
        let (origin, tenant, pr) = (r.origin, r.tenant.clone(), r.land.pages()[idx]);
        let (origin_node, rkey) = (r.origin_node, r.rkey);
        let remote_addr = r.base + (idx * self.stride) as u64;
        let result = if slots == usize::MAX {
            Err("write beyond the prompt's pages".to_owned())
        } else {
            self.engine
                .verify_import(id, idx, slots, checksum)
                .map_err(|e| e.to_string())
        };
        if self.engine.core().auditing() {
            let checksum_v = self.engine.core().pool().landed_checksum(pr.page);
            self.engine.record(audit::Event::Transfer {
                ts_ns: audit::mono_now_ns(),
                transfer: super::transfer_id(origin, idx),
                request: id,
                tenant,
                src_node: origin_node,
                src_page: u32::MAX,
                src_generation: 0,
                dst_node: self.opts.node_id,
                dst_page: pr.page,
                dst_generation: pr.generation,
                bytes: (slots.min(ps) * self.stride / ps) as u64,
                checksum: checksum_v,
                outcome: match &result {
                    Ok(()) => "verified".into(),
                    Err(e) => format!("rejected: {e}"),
                },
                rkey,
                remote_addr,
                remote_len: self.stride as u64,
                // The target does not see the chain, only what landed.
                wire_bytes: 0,
                work_requests: 0,
            });
        }
        match result {
            Ok(()) => {
                self.stats.verified_pages += 1;
                let Some(r) = self.reqs.get_mut(&id) else {
                    return;
                };
                r.verified[idx] = true;
                if r.verified[..n_prompt_pages.min(r.verified.len())]
                    .iter()
                    .all(|&v| v)
                {
                    self.transition(id, &[ReqEvent::AllVerified]).discard(
                        "an illegal transition already failed the request inside `transition`",
                    );
                }
            }
            Err(e) => {
                self.stats.verify_failures += 1;
                tracing::warn!(request = id, page = pr.page, error = %e, "transferred page failed verification");
                self.end(
                    id,
                    ReqEvent::Fail,
                    RequestKind::Failed {
                        reason: format!("transfer: {e}"),
                    },
                    Some(e),
                );
            }
        }
    }

    fn commit(&mut self, c: proto::CommitRequest) -> Result<TokenRx, Status> {
        let id = c.request;
        let legacy = self.opts.unsafe_.truncate_overlength;
        let r = self.reqs.get_mut(&id).ok_or_else(|| {
            Status::not_found(format!(
                "no request {id} on this decode node (failed or aborted)"
            ))
        })?;
        if legacy
            && matches!(
                r.machine.state(),
                ReqState::Reserved | ReqState::Transferring
            )
        {
            // UNSAFE (incident reproduction): prefill "reported the transfer complete", and the
            // legacy decode believed it — the model checker's `LEGACY` completion, which offers
            // `AllVerified` without verifying.
            tracing::error!(
                request = id,
                "UNSAFE REPRODUCTION: handing off a request whose pages were not all verified"
            );
            if let Err(e) = r.machine.observe_posted() {
                return Err(self.fail_illegal(id, e));
            }
            self.transition(id, &[ReqEvent::AllVerified])?;
        }
        let handed_off = {
            let r = self
                .reqs
                .get_mut(&id)
                .ok_or_else(|| Status::not_found(format!("no request {id} on this decode node")))?;
            match r.machine.handoff() {
                Ok(h) => h,
                Err(e) => return Err(self.fail_illegal(id, e)),
            }
        };
        // No further write is expected: invalidate the key now, so nothing can land in pages that
        // decode is about to read and append to.
        let rkey = self.reqs.get(&id).map(|r| r.rkey).unwrap_or(0);
        let proof = match self.transport.invalidate(rkey) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(request = id, error = %e, "cannot invalidate the transfer key at handoff");
                self.end(
                    id,
                    ReqEvent::Fail,
                    RequestKind::Failed {
                        reason: "invalidate".into(),
                    },
                    Some(e.to_string()),
                );
                return Err(Status::internal("cannot invalidate the transfer key"));
            }
        };
        let activated = self
            .engine
            .activate_import(id, c.first_token, !legacy, &proof, handed_off);
        let (tokens, rx) = mpsc::channel(super::token_relay_capacity_events(
            self.reqs.get(&id).map_or(0, |r| r.max_tokens),
        ));
        if let Some(r) = self.reqs.get_mut(&id) {
            r.invalidated = Some(proof);
            r.tokens = Some(tokens);
        }
        if let Err(e) = activated {
            self.end(
                id,
                ReqEvent::Fail,
                RequestKind::Failed {
                    reason: e.to_string(),
                },
                Some(e.to_string()),
            );
            return Err(Status::failed_precondition(e.to_string()));
        }
        Ok(rx)
    }

    /// End a request that did not finish normally: quarantine its pages, invalidate its key,
    /// and free the pages only once the key is invalidated (safety property 2).
    fn end(&mut self, id: RequestId, ev: ReqEvent, kind: RequestKind, error: Option<String>) {
        self.end_with(
            id,
            ev,
            FrontEnd {
                kind,
                delivered_tokens: None,
            },
            error,
        );
    }

    /// [`Self::end`], recording `end.delivered_tokens` output tokens when given.
    fn end_with(&mut self, id: RequestId, ev: ReqEvent, end: FrontEnd, error: Option<String>) {
        let FrontEnd {
            kind,
            delivered_tokens,
        } = end;
        let Some(mut r) = self.reqs.remove(&id) else {
            return;
        };
        let kind = match r.machine.end(ev) {
            Ok(_) => kind,
            Err(e) => {
                tracing::error!(request = id, error = %e, "illegal end of a request: failed");
                RequestKind::Failed {
                    reason: format!("request {id}: {e}"),
                }
            }
        };
        self.by_slot.remove(&r.slot);
        self.by_key.remove(&r.rkey);
        if let (Some(tx), Some(e)) = (&r.tokens, &error) {
            tx.try_send(Err(Status::aborted(e.clone()))).discard("the relay holds every event of a request (never full); closed: the client went away");
        }
        self.engine.quarantine(id, kind, delivered_tokens);
        let proof = match r.invalidated.take() {
            Some(p) => Ok(p),
            None => self.transport.invalidate(r.rkey),
        };
        let released = match &proof {
            Ok(p) => self.engine.release_quarantined(id, Some(p)),
            Err(e) => {
                tracing::error!(request = id, error = %e, "key not invalidated: pages stay quarantined");
                return;
            }
        };
        match released {
            // The slot is reused only after the key is dead: a late completion can't be misrouted.
            Ok(()) => self.free_slots.push(r.slot),
            Err(e) => tracing::error!(request = id, error = %e, "pages stay quarantined"),
        }
    }

    fn step(&mut self) -> bool {
        if !self.engine.has_work() {
            return false;
        }
        for ev in self.engine.step() {
            match ev {
                Event::Token {
                    id,
                    token,
                    logprobs,
                } => {
                    if let Some(tx) = self.reqs.get(&id).and_then(|r| r.tokens.as_ref()) {
                        tx.try_send(Ok(proto::TokenEvent {
                            token,
                            logprobs: logprobs.as_deref().map(super::logprobs_to_proto),
                            ..Default::default()
                        })).discard("the relay holds every event of a request (never full); closed: the client went away");
                    }
                }
                Event::Finished {
                    id,
                    reason,
                    prompt_tokens,
                    generated_tokens,
                    ..
                } => {
                    if let Some(mut r) = self.reqs.remove(&id) {
                        self.by_slot.remove(&r.slot);
                        self.by_key.remove(&r.rkey);
                        self.free_slots.push(r.slot);
                        debug_assert!(r.invalidated.is_some(), "a decoding request's key is dead");
                        if let Err(e) = r.machine.end(ReqEvent::Finish) {
                            tracing::error!(request = id, error = %e, "engine finished a request the protocol did not let decode");
                        }
                        if let Some(tx) = r.tokens {
                            tx.try_send(Ok(proto::TokenEvent {
                                finish_reason: match reason {
                                    crate::engine::FinishReason::Stop => "stop".into(),
                                    crate::engine::FinishReason::Length => "length".into(),
                                },
                                prompt_tokens: prompt_tokens as u32,
                                generated_tokens: generated_tokens as u32,
                                ..Default::default()
                            })).discard("the relay holds every event of a request (never full); closed: the client went away");
                        }
                    }
                }
                Event::Failed { id, error } => {
                    // The engine released the pages (key already invalidated at handoff).
                    if let Some(mut r) = self.reqs.remove(&id) {
                        if let Err(e) = r.machine.end(ReqEvent::Fail) {
                            tracing::error!(request = id, error = %e, "illegal failure transition");
                        }
                        self.by_slot.remove(&r.slot);
                        self.by_key.remove(&r.rkey);
                        self.free_slots.push(r.slot);
                        if let Some(tx) = r.tokens {
                            tx.try_send(Err(Status::data_loss(format!(
                                "integrity check failed: {error}"
                            )))).discard("the relay holds every event of a request (never full); closed: the client went away");
                        }
                    }
                }
                Event::Aborted { id, reason } => {
                    if let Some(mut r) = self.reqs.remove(&id) {
                        if let Err(e) = r.machine.end(ReqEvent::Abort) {
                            tracing::error!(request = id, error = %e, "illegal abort transition");
                        }
                        self.by_slot.remove(&r.slot);
                        self.by_key.remove(&r.rkey);
                        if let Some(tx) = r.tokens {
                            tx.try_send(Err(Status::unavailable(reason))).discard("the relay holds every event of a request (never full); closed: the client went away");
                        }
                    }
                }
                Event::Prefilled { .. } => {}
            }
        }
        true
    }

    /// Abort requests whose client went away or whose reservation lease expired.
    fn reap(&mut self) {
        let lease = self.opts.reservation_lease;
        let mut gone = Vec::new();
        for (&id, r) in &self.reqs {
            let closed = r.tokens.as_ref().is_some_and(|t| t.is_closed());
            let expired = r.tokens.is_none() && r.reserved_at.elapsed() > lease;
            if closed || expired {
                gone.push((id, expired));
            }
        }
        for (id, expired) in gone {
            if expired {
                self.stats.leases_expired += 1;
                tracing::warn!(
                    request = id,
                    "reservation lease expired without a commit: aborting (key invalidated before pages are freed)"
                );
            }
            let reason = if expired {
                "reservation lease expired"
            } else {
                "client_disconnected"
            };
            let kind = RequestKind::Aborted {
                reason: reason.into(),
            };
            self.end(id, ReqEvent::Abort, kind, None);
        }
    }

    fn stats(&self) -> DecodeStats {
        DecodeStats {
            pool_pages: self.engine.core().pool().n_pages(),
            free_pages: self.engine.core().pool().n_free(),
            quarantined_pages: self.engine.n_quarantined_pages(),
            live_requests: self.engine.n_live(),
            reservations: self.reqs.len(),
            transport: self.transport.target_stats(),
            ..self.stats
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Handshake(peer, tx) => {
                tx.send(self.handshake(peer))
                    .discard("the asker went away before its answer");
            }
            Cmd::Reserve(req, decoding, tx) => {
                tx.send(self.reserve(req, *decoding))
                    .discard("the asker went away before its answer");
            }
            Cmd::Commit(c, tx) => {
                tx.send(self.commit(c))
                    .discard("the asker went away before its answer");
            }
            Cmd::Abort(id, end, tx) => {
                let existed = self.reqs.contains_key(&id);
                if existed {
                    tracing::info!(request = id, end = ?end.kind, "ended by prefill");
                    let note = match &end.kind {
                        RequestKind::Aborted { reason } => reason.clone(),
                        other => format!("{} by the front", other.name()),
                    };
                    self.end_with(id, ReqEvent::Abort, end, Some(note));
                }
                tx.send(existed)
                    .discard("the asker went away before its answer");
            }
            Cmd::Stats(tx) => {
                tx.send(self.stats())
                    .discard("the asker went away before its answer");
            }
            #[cfg(feature = "test-oracle")]
            Cmd::Inspect(layer, pages, tx) => {
                let pool = self.engine.core().pool();
                let out = pages
                    .iter()
                    .map(|&p| pool.test_oracle_k_page_bytes(layer, p))
                    .collect();
                tx.send(out)
                    .discard("the asker went away before its answer");
            }
            #[cfg(feature = "fault-injection")]
            Cmd::Fault(f) => match f {
                DecodeFault::CorruptNextPayload => {
                    if let Err(e) = self
                        .transport
                        .fault_inject(FaultInjection::CorruptNextPayload)
                    {
                        tracing::warn!(error = %e, "fault injection refused");
                    }
                }
                DecodeFault::HoldNextReservation => self.hold_next = true,
                DecodeFault::ReleaseHeld => {
                    let n = self
                        .transport
                        .fault_inject(FaultInjection::ReleaseHeld)
                        .unwrap_or(0);
                    tracing::info!(n, "fault injection: delivering held writes late");
                }
            },
        }
    }
}

/// How long the engine thread may sleep while reservations wait for bytes: the tcp transport
/// is read on this thread (no reactor wakes it), so landing latency is at most this.
const LANDING_POLL: Duration = Duration::from_micros(500);
/// How often reservation leases and closed token relays are looked at.
const REAP_INTERVAL: Duration = Duration::from_millis(20);
/// How often an idle decode node still reads its transport (see `work`).
const IDLE_TRANSPORT_POLL: Duration = Duration::from_millis(20);

impl crate::actor::Actor for Node {
    type Cmd = Cmd;
    /// Its peers are gone: nothing is left to serve.
    const FINISH_WORK_ON_CLOSE: bool = false;

    fn handle(&mut self, cmd: Cmd) -> crate::actor::Control {
        Node::handle(self, cmd);
        crate::actor::Control::Continue
    }

    fn work(&mut self) -> crate::actor::Work {
        use crate::actor::Work;
        let mut busy = self.poll_transport() > 0;
        busy |= self.step();
        if self.last_reap.elapsed() > REAP_INTERVAL {
            self.reap();
            self.last_reap = Instant::now();
        }
        if busy {
            Work::Busy
        } else if self.reqs.values().any(|r| r.tokens.is_none()) {
            // Reservations wait for their bytes (and their lease).
            Work::PollAfter(LANDING_POLL)
        } else if !self.reqs.is_empty() {
            // Decoding requests whose clients may go away.
            Work::PollAfter(REAP_INTERVAL)
        } else {
            // Never fully idle: a write for a reservation this node no longer holds (its lease
            // expired, it was aborted, its pairing withdrawn) must still be read — refused and
            // acknowledged — or its sender waits for that completion forever.
            Work::PollAfter(IDLE_TRANSPORT_POLL)
        }
    }
}

/// Handle to a running decode node's engine thread.
#[derive(Clone, Debug)]
pub struct DecodeHandle {
    tx: Mailbox<Cmd>,
    /// The peer checkpoint exchange (`None`: refused).
    checkpoints: Option<Arc<dyn custody_audit::CheckpointExchange>>,
    /// The transport's endpoint: `tcp`, its listening address; `verbs`, the queue pair's.
    pub transport_addr: String,
    pub info: proto::NodeInfo,
    drain: super::Drain,
    /// Compiles the constraints reservations carry.
    grammars: Option<Arc<custody_engine::grammar::Grammars>>,
    vocab: usize,
    /// This node's log, for tenants' promises and proofs.
    proofs: Option<Arc<dyn crate::proofs::NodeProofs>>,
    gate: Option<Arc<dyn crate::proofs::AuditGate>>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cmd::Handshake(..) => "Handshake",
            Cmd::Reserve(..) => "Reserve",
            Cmd::Commit(..) => "Commit",
            Cmd::Abort(..) => "Abort",
            Cmd::Stats(..) => "Stats",
            #[cfg(feature = "fault-injection")]
            Cmd::Fault(..) => "Fault",
            #[cfg(feature = "test-oracle")]
            Cmd::Inspect(..) => "Inspect",
        })
    }
}

/// Commands waiting for the engine thread (bounded: a full queue answers `unavailable`).
const CMD_QUEUE_CMDS: usize = 1024;

impl DecodeHandle {
    /// Start the engine thread and the KV transport listener. `engine` (idle) takes the decode
    /// role.
    pub fn start(
        engine: Engine,
        opts: DecodeOptions,
    ) -> Result<Self, crate::transport::TransportError> {
        let engine = DecodeEngine::new(engine);
        let transport = crate::transport::open_target(
            opts.node_id,
            &opts.transport_kind,
            opts.transport_listen,
            opts.kv_encryption.clone(),
        )?;
        let transport_addr = transport.endpoint();
        let checkpoints = opts.checkpoints.as_ref().map(|p| p.book.clone());
        let drain = opts.drain.clone();
        let grammars = opts.grammars.clone();
        let proofs = opts.proofs.clone();
        let gate = opts.gate.clone();
        let vocab = engine.core().model().config.vocab_size;
        let stride = engine.core().pool().region_page_stride();
        let info = super::node_info(
            engine.core().model(),
            &opts.fingerprint,
            opts.node_id,
            "decode",
            engine.core().pool().geometry(),
            engine.core().context_length(),
            engine.core().pool().n_pages() * engine.core().pool().page_size(),
            transport.kind(),
            transport_addr.clone(),
            &opts.unsafe_.names(),
        );
        let info = proto::NodeInfo {
            transport_encryption: opts.kv_encryption.is_on(),
            epoch: super::draw_epoch()?,
            ..info
        };
        let node = Node {
            engine,
            transport,
            opts,
            reqs: HashMap::new(),
            by_slot: HashMap::new(),
            by_key: HashMap::new(),
            pairings: HashMap::new(),
            free_slots: Vec::new(),
            next_slot: 0,
            stats: DecodeStats::default(),
            last_reap: Instant::now(),
            #[cfg(feature = "fault-injection")]
            hold_next: false,
            info: info.clone(),
            stride,
        };
        let (tx, _join) = actor::spawn(
            "decode-engine",
            node,
            ActorLimits::with_queue(CMD_QUEUE_CMDS),
        )?;
        Ok(Self {
            tx,
            checkpoints,
            transport_addr,
            info,
            drain,
            grammars,
            vocab,
            proofs,
            gate,
        })
    }

    fn send(&self, cmd: Cmd) -> Result<(), Status> {
        match self.tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(MailboxError::Full { .. }) => {
                Err(Status::unavailable("decode node command queue full"))
            }
            Err(MailboxError::Stopped(_)) => Err(Status::unavailable("decode engine stopped")),
        }
    }

    /// Counters (blocking).
    pub fn stats_blocking(&self) -> Option<DecodeStats> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Stats(tx)).ok()?;
        rx.blocking_recv().ok()
    }

    pub async fn stats(&self) -> Option<DecodeStats> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Stats(tx)).ok()?;
        rx.await.ok()
    }

    /// Test oracle (feature `test-oracle`): the raw K bytes of `layer` for `pages` (page layout
    /// `[kv_head][slot][dim]`), read straight from pool memory *without* the tag check — what
    /// an attacker with the incident's bug would attend over. Never compiled into a binary.
    #[cfg(feature = "test-oracle")]
    pub fn inspect_k_blocking(&self, layer: usize, pages: Vec<u32>) -> Option<Vec<Vec<u8>>> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Inspect(layer, pages, tx)).ok()?;
        rx.blocking_recv().ok()
    }

    /// Fault injection (feature `fault-injection`, tests only).
    #[cfg(feature = "fault-injection")]
    pub fn fault_inject(&self, f: DecodeFault) {
        self.send(Cmd::Fault(f))
            .discard("fault injection on a stopped engine has nothing to inject into");
    }

    /// Whether the node is draining (refusing new reservations).
    pub fn draining(&self) -> bool {
        self.drain.is_draining()
    }

    /// The gRPC service over this handle.
    pub fn service(&self) -> DecodeService {
        DecodeService { h: self.clone() }
    }
}

/// The `Decode` gRPC service.
#[derive(Debug, Clone)]
pub struct DecodeService {
    h: DecodeHandle,
}

async fn ask<T>(
    h: &DecodeHandle,
    make: impl FnOnce(oneshot::Sender<T>) -> Cmd,
) -> Result<T, Status> {
    let (tx, rx) = oneshot::channel();
    h.send(make(tx))?;
    rx.await
        .map_err(|_| Status::unavailable("decode engine stopped"))
}

type TokenStream = Pin<Box<dyn Stream<Item = Result<proto::TokenEvent, Status>> + Send>>;

#[tonic::async_trait]
impl decode_server::Decode for DecodeService {
    async fn handshake(
        &self,
        r: Request<proto::NodeInfo>,
    ) -> Result<Response<proto::NodeInfo>, Status> {
        let caller = r.extensions().get::<crate::tls::Caller>().copied();
        let peer = r.into_inner();
        // The node id a prefill node states is the one its certificate names.
        if let Some(crate::tls::Caller(id)) = caller
            && id.node != peer.node_id
        {
            tracing::warn!(caller = %id, stated = peer.node_id, "handshake refused: node id differs from the certificate's");
            return Err(Status::permission_denied(format!(
                "handshake states node {} but the certificate is {id}",
                peer.node_id
            )));
        }
        ask(&self.h, |tx| Cmd::Handshake(peer, tx))
            .await?
            .map(Response::new)
    }

    async fn reserve(
        &self,
        r: Request<proto::ReserveRequest>,
    ) -> Result<Response<proto::ReserveReply>, Status> {
        crate::proofs::refused(self.h.gate.as_ref())?;
        let caller = r.extensions().get::<crate::tls::Caller>().copied();
        let req = r.into_inner();
        // A prefill node reserves only under its own node id (its pairing's regions).
        if let Some(crate::tls::Caller(id)) = caller
            && id.node != req.origin_node
        {
            return Err(Status::permission_denied(format!(
                "reserve states prefill node {} but the certificate is {id}",
                req.origin_node
            )));
        }
        // Decode samples every token after the first: the constraint travels with the request
        // and is compiled here, on the blocking pool.
        let (grammars, vocab, wire) = (self.h.grammars.clone(), self.h.vocab, req.decoding.clone());
        let decoding = tokio::task::spawn_blocking(move || {
            super::decoding_from_proto(wire, vocab, grammars.as_deref())
        })
        .await
        .map_err(|e| Status::internal(format!("constraint compiler task failed: {e}")))??;
        ask(&self.h, |tx| Cmd::Reserve(req, Box::new(decoding), tx))
            .await?
            .map(Response::new)
    }

    type CommitStream = TokenStream;

    async fn commit(
        &self,
        r: Request<proto::CommitRequest>,
    ) -> Result<Response<Self::CommitStream>, Status> {
        let c = r.into_inner();
        let trx = ask(&self.h, |tx| Cmd::Commit(c, tx)).await??;
        let stream = tokio_stream::wrappers::ReceiverStream::new(trx);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn abort(
        &self,
        r: Request<proto::AbortRequest>,
    ) -> Result<Response<proto::AbortReply>, Status> {
        let a = r.into_inner();
        let end = FrontEnd::from_proto(&a)?;
        let existed = ask(&self.h, |tx| Cmd::Abort(a.request, end, tx)).await?;
        Ok(Response::new(proto::AbortReply { existed }))
    }

    async fn exchange_checkpoints(
        &self,
        r: Request<proto::Checkpoints>,
    ) -> Result<Response<proto::Checkpoints>, Status> {
        let Some(book) = self.h.checkpoints.clone() else {
            return Err(Status::unimplemented(
                "this decode node keeps no peer checkpoints (no audit log)",
            ));
        };
        let sent = r.into_inner();
        let own = crate::checkpoints::own_message(&*book);
        // The log's queue is bounded and may make the recording wait: off the async workers.
        tokio::task::spawn_blocking(move || crate::checkpoints::keep(&*book, &sent))
            .await
            .map_err(|_| Status::internal("keeping the peer's checkpoints"))??;
        Ok(Response::new(own))
    }

    async fn proof(
        &self,
        r: Request<proto::ProofRequest>,
    ) -> Result<Response<proto::ProofReply>, Status> {
        let req = r.into_inner();
        if req.node != self.h.info.node_id {
            return Err(Status::not_found(format!(
                "this is decode node {}, not node {}",
                self.h.info.node_id, req.node
            )));
        }
        crate::proofs::local(self.h.proofs.as_ref(), req)
            .await
            .map(Response::new)
    }
}

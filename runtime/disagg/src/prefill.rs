//! The prefill node: the front door. Admits, reserves on decode, computes the prompt's KV,
//! writes it into decode's pages over the KV transport, hands the request off, relays tokens.
//!
//! One engine thread owns the engine, its pool and the transport's initiator side; per-request
//! async tasks (gRPC `Generate`) drive the protocol against the decode node's gRPC service.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use custody_audit::{self as audit, RequestKind};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::proto::{self, decode_client::DecodeClient, prefill_server};
use super::protocol::{IllegalTransition, ReqEvent, ReqMachine};
use super::{admission_status, imm_of, transfer_id};
use crate::actor::{self, ActorLimits, Mailbox, MailboxError};
use crate::engine::{Engine, Event, GenerateRequest, PrefillEngine, RequestId};
use crate::kv::TransferHeader;
use crate::tls::{NodeIdentity, Role, Security};
use crate::transport::abi::{self, SendWr, Wc};
use crate::transport::{KvTransport, TransportError, TransportKind};
use custody_engine::config::UnsafeReproduction;

#[cfg(feature = "fault-injection")]
mod faults;
#[cfg(feature = "fault-injection")]
pub use faults::PrefillFault;

/// Prefill node settings.
#[derive(Clone, Debug)]
pub struct PrefillOptions {
    pub node_id: u32,
    pub unsafe_: UnsafeReproduction,
    pub fingerprint: String,
    /// How long a request waits for decode pages (`Busy`) before it is refused.
    pub reserve_wait: Duration,
    /// `tcp` or `verbs` (must match the decode node's).
    pub transport_kind: TransportKind,
    /// TLS on the KV transport's connection (`[disagg] transport_encryption`; the client side,
    /// naming the decode node). Must match the decode node's.
    pub kv_encryption: crate::transport::KvEncryption,
    /// Exchange checkpoints with the decode node: keep its newest in this node's log, send it
    /// this node's (`None`: no exchange, e.g. without an audit writer).
    pub checkpoints: Option<crate::checkpoints::PeerCheckpoints>,
    /// The prefix cache's namespaces (`None`: nothing cached here). A request's scope is made
    /// from the tenant its authenticated front asserted and the client's `cache_salt`; the
    /// cached pages are transferred like any other (checksummed, verified on decode).
    pub namespaces: Option<Arc<custody_engine::prefix_cache::Namespaces>>,
}

/// The requests a front may still end early, by this node's request id: the decode request each
/// was reserved as. An entry lives while its `generate` runs (bounded by the live requests).
#[derive(Debug, Default)]
struct Relays(std::sync::Mutex<HashMap<RequestId, u64>>);

impl Relays {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, u64>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Removes its request from [`Relays`] when its `generate` returns, however it returns.
struct RelayEntry {
    relays: Arc<Relays>,
    id: RequestId,
}

impl Drop for RelayEntry {
    fn drop(&mut self) {
        self.relays.lock().remove(&self.id);
    }
}

/// Why a request's transfer (or its prefill) failed, as prefill saw it: the reason recorded in
/// its `requests` row and told to the client.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TransferFailed(pub String);

impl From<String> for TransferFailed {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl From<&str> for TransferFailed {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

/// How a request's transfer ended, as seen by prefill: the first token, or why not.
type TransferResult = Result<u32, TransferFailed>;

/// A prompt's KV is computed (its first token travels with the transfer's result): how many
/// of its tokens came from the prefix cache.
#[derive(Clone, Copy, Debug)]
struct Prefilled {
    cached_tokens: usize,
}

/// How a prompt's prefill ended: [`Prefilled`], or why not.
type PrefillResult = Result<Prefilled, TransferFailed>;

/// Why a lost transport connection could not be re-established (retried).
#[derive(Debug, thiserror::Error)]
enum ReconnectError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("handshake timed out")]
    Timeout,
    #[error("handshake refused: {0}")]
    Refused(String),
    #[error(transparent)]
    Pair(#[from] super::PairMismatch),
}

/// The `node_events` kind that names, for each admitted request, the authenticated front that
/// asserted its tenant (`request=<id> tenant=<tenant> front=custody-node:front:<n>`).
pub const FRONT_REQUEST_EVENT: &str = "front_request";

enum Cmd {
    /// Admit a prompt (prefill-only). Replies with the prefill request id and whether the
    /// (legacy) path truncated it; `prefilled` fires when its KV is computed (first token).
    Submit(
        GenerateRequest,
        Option<NodeIdentity>,
        oneshot::Sender<Result<(RequestId, bool), Status>>,
        oneshot::Sender<PrefillResult>,
    ),
    /// Decode's reservation for a submitted request; the reply fires when the transfer is over.
    Attach(
        RequestId,
        proto::ReserveReply,
        oneshot::Sender<TransferResult>,
    ),
    Abort(RequestId, String),
    #[cfg(feature = "fault-injection")]
    Fault(PrefillFault),
    Stats(oneshot::Sender<PrefillStats>),
}

/// A prefill node's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillStats {
    pub pool_pages: usize,
    pub free_pages: usize,
    pub live_requests: usize,
    pub transfers_in_flight: usize,
    pub reconnects: u64,
}

/// What was posted for one page (its `transfers` row): source page and generation, data bytes,
/// checksum, and the chain as it went out (key, page address and span in the region, bytes of
/// every work request, their number) — what the eBPF witness's observations are checked against.
#[derive(Clone, Copy, Debug)]
struct SentPage {
    page: u32,
    generation: u32,
    bytes: u64,
    checksum: u64,
    rkey: u32,
    remote_addr: u64,
    remote_len: u64,
    wire_bytes: u64,
    work_requests: u32,
}

struct PReq {
    /// This node's view of the request in the protocol; changed only through its `on`.
    machine: ReqMachine,
    tenant: Arc<str>,
    reservation: Option<proto::ReserveReply>,
    first_token: Option<u32>,
    prefilled: Option<oneshot::Sender<PrefillResult>>,
    done: Option<oneshot::Sender<TransferResult>>,
    outstanding: usize,
    failed: Option<String>,
    /// Per transferred page, what its audit row says.
    sent: Vec<SentPage>,
    /// Per prompt page: (page, slots, checksum), computed when the prefill completed — while the
    /// reservation round trip is in flight and the KV is still warm in cache — so that hashing
    /// is off the transfer's path. The pages are held unchanged until the transfer ends.
    checksums: Vec<(u32, usize, u64)>,
}

/// The in-band headers of writes in flight, one slot per page of this node's pool: the header
/// of a transfer of source page `p` lives in slot `p`. A page is in at most one transfer at a
/// time and stays held until that transfer's completions arrive, so a slot is never rewritten
/// while a NIC may still read it. One allocation, registered once with the transport (`verbs`
/// gathers only from registered memory); it never moves (a boxed slice).
struct HeaderArena(Box<[[u8; crate::kv::TRANSFER_HDR_BYTES]]>);

struct Node {
    /// Declared (so dropped) before the memory registered with it: the engine's pool and the
    /// header arena.
    transport: Box<dyn KvTransport>,
    engine: PrefillEngine,
    headers: HeaderArena,
    opts: PrefillOptions,
    decode_node: u32,
    reqs: HashMap<RequestId, PReq>,
    /// Re-run the handshake on a lost transport connection (it carries the endpoints).
    control: Reconnect,
    last_reconnect: Instant,
    reconnects: u64,
    /// Faults armed by tests (feature `fault-injection`; not compiled into a binary).
    #[cfg(feature = "fault-injection")]
    fault: faults::FaultState,
}

/// What a reconnect needs: the control-plane client and this node's handshake statement.
struct Reconnect {
    rt: tokio::runtime::Handle,
    decode: DecodeClient<Channel>,
    info: proto::NodeInfo,
}

impl Node {
    fn submit(
        &mut self,
        mut req: GenerateRequest,
        front: Option<NodeIdentity>,
        prefilled: oneshot::Sender<PrefillResult>,
    ) -> Result<(RequestId, bool), Status> {
        let mut truncated = false;
        // Only the legacy path looks before it leaps; otherwise `PrefillEngine::submit` checks and
        // records the rejection itself.
        if self.opts.unsafe_.truncate_overlength
            && let Err(e) = self.engine.check(&req)
            && e.is_over_length()
        {
            // UNSAFE (incident reproduction): the legacy "rejection" — swap the prompt for a
            // one-token placeholder and let the request flow on.
            tracing::error!(
                prompt_tokens = req.prompt.len(),
                error = %e,
                "UNSAFE REPRODUCTION: over-length prompt truncated to 1 token instead of rejected"
            );
            req.prompt.truncate(1);
            truncated = true;
        }
        let tenant: Arc<str> = req.tenant.as_str().into();
        let id = self.engine.submit(req).map_err(|e| admission_status(&e))?;
        if let Some(front) = front {
            // Who asserted the tenant: the authenticated front, beside the request's rows.
            self.engine.record(audit::Event::Node {
                ts_ns: audit::mono_now_ns(),
                kind: FRONT_REQUEST_EVENT.into(),
                detail: format!("request={id} tenant={tenant} front={front}"),
            });
        }
        self.reqs.insert(
            id,
            PReq {
                machine: ReqMachine::new(),
                tenant,
                reservation: None,
                first_token: None,
                prefilled: Some(prefilled),
                done: None,
                outstanding: 0,
                failed: None,
                sent: Vec::new(),
                checksums: Vec::new(),
            },
        );
        Ok((id, truncated))
    }

    fn attach(
        &mut self,
        id: RequestId,
        res: proto::ReserveReply,
        done: oneshot::Sender<TransferResult>,
    ) {
        let Some(r) = self.reqs.get_mut(&id) else {
            let _ = done.send(Err(format!("prefill request {id} is gone").into()));
            return;
        };
        r.reservation = Some(res);
        r.done = Some(done);
        // Decode's pages exist from here on; prefill starts the transfer phase for them.
        if let Err(e) = r
            .machine
            .on_all(&[ReqEvent::Reserve, ReqEvent::StartPrefill])
        {
            self.fail_illegal(id, e);
            return;
        }
        if r.first_token.is_some() {
            self.post(id);
        }
    }

    /// The transfer checksum of every prompt page `id` holds: (page, slots, checksum).
    fn checksums(&self, id: RequestId) -> Vec<(u32, usize, u64)> {
        let Some((pages, n_cached)) = self.engine.held(id) else {
            return Vec::new();
        };
        let pool = self.engine.core().pool();
        let ps = pool.page_size();
        pages
            .iter()
            .take(n_cached.div_ceil(ps))
            .enumerate()
            .map(|(idx, pr)| {
                let slots = (n_cached - idx * ps).min(ps);
                (pr.page, slots, pool.page_checksum(pr.page, slots))
            })
            .collect()
    }

    /// Post the writes of every prompt page of `id` (called when both the KV and the
    /// reservation are there).
    fn post(&mut self, id: RequestId) {
        let Some((pages, n_cached)) = self.engine.held(id).map(|(p, n)| (p.to_vec(), n)) else {
            self.finish(id, Err("prefill pages are gone".into()));
            return;
        };
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        let Some(res) = r.reservation.clone() else {
            return;
        };
        #[cfg(feature = "fault-injection")]
        let injected = self.fault.take_injected_event();
        #[cfg(not(feature = "fault-injection"))]
        let injected: Option<ReqEvent> = None;
        let moved = match injected {
            Some(ev) => r.machine.on_all(&[ev, ReqEvent::PostWrites]),
            None => r.machine.on(ReqEvent::PostWrites),
        };
        if let Err(e) = moved {
            self.fail_illegal(id, e);
            return;
        }
        let pool = self.engine.core().pool();
        let ps = pool.page_size();
        let n_pages = n_cached.div_ceil(ps);
        if n_pages > res.pages.len() {
            self.finish(
                id,
                Err(format!(
                    "decode reserved {} pages, the prompt needs {n_pages}",
                    res.pages.len()
                )
                .into()),
            );
            return;
        }
        let stride = res.page_stride;
        let mut posted = 0;
        let mut error = None;
        // Test-only faults (see `PrefillFault`): (page index, wr_id) of one extra write.
        #[cfg(feature = "fault-injection")]
        let extra = self.fault.extra_write(id, n_pages, &res.pages);
        // Every page's chain is built first, then posted in groups: the pages' chains linked
        // into one chain of at most POST_WRS_MAX work requests (one post and one doorbell per
        // group, as RDMA engines batch their writes; the witness's probe fires once per post).
        // A group is all or nothing; a failed post stops the rest.
        let mut chains: Vec<(Vec<abi::Sge>, Vec<SendWr>)> = Vec::with_capacity(n_pages);
        let mut sent: Vec<SentPage> = Vec::with_capacity(n_pages);
        for (idx, pr) in pages.iter().enumerate().take(n_pages) {
            let slots = (n_cached - idx * ps).min(ps);
            let mut bytes = 0u64;
            pool.for_each_transfer_chunk(pr.page, slots, |_, b| bytes += b.len() as u64);
            let checksum = match r.checksums.get(idx) {
                Some(&(page, s, c)) if page == pr.page && s == slots => c,
                _ => pool.page_checksum(pr.page, slots),
            };
            let dst = res.pages[idx];
            let header = &mut self.headers.0[pr.page as usize];
            *header = TransferHeader {
                owner: res.request,
                generation: dst.generation,
                slots: slots as u32,
                checksum,
            }
            .encode();
            let page_base = res.base + idx as u64 * stride;
            let (sges, wrs) = super::page_write_chain(
                pool,
                pr.page,
                slots,
                page_base,
                res.rkey,
                transfer_id(id, idx),
                imm_of(res.imm_slot, idx),
                &header[..],
            );
            sent.push(SentPage {
                page: pr.page,
                generation: pr.generation,
                bytes,
                checksum,
                rkey: res.rkey,
                remote_addr: page_base,
                remote_len: stride,
                wire_bytes: sges.iter().map(|s| u64::from(s.length)).sum(),
                work_requests: wrs.len() as u32,
            });
            chains.push((sges, wrs));
        }
        debug_assert_eq!(chains.len(), n_pages);
        let mut first = 0;
        while first < n_pages {
            // The group: pages first..end, at least one, at most POST_WRS_MAX requests.
            let end = super::link_post_group(&mut chains, first);
            #[cfg(feature = "fault-injection")]
            if let Some(x) = extra
                && (first..end).contains(&x.page_index)
            {
                faults::post_unrecorded_copy(
                    &mut *self.transport,
                    &chains[x.page_index],
                    x,
                    res.rkey,
                );
            }
            // SAFETY: every SGE points into this node's pool pages (held, not written until
            // released after the completion) or into the page's header slot (see
            // `HeaderArena`), both registered with the transport at start; the linked chains
            // live in `chains` (their heap buffers do not move) for the duration of the call.
            let res_post = unsafe { self.transport.post_write(&chains[first].1[0]) };
            match res_post {
                Ok(()) => {
                    posted += end - first;
                    r.sent.extend_from_slice(&sent[first..end]);
                }
                Err(e) => {
                    error = Some(format!("posting the KV transfer failed: {e}"));
                    break;
                }
            }
            first = end;
        }
        #[cfg(feature = "fault-injection")]
        self.fault.after_post(id, n_pages, &res.pages);
        r.outstanding += posted;
        if let Some(e) = error {
            r.failed.get_or_insert(e);
            if r.outstanding == 0 {
                let e = r.failed.clone().unwrap_or_default();
                self.finish(id, Err(e.into()));
            }
        }
    }

    fn on_completion(&mut self, wc: Wc) {
        let (origin, idx) = (wc.wr_id >> 16, (wc.wr_id & 0xffff) as usize);
        let Some(r) = self.reqs.get_mut(&origin) else {
            return;
        };
        r.outstanding = r.outstanding.saturating_sub(1);
        let outcome = if wc.ok() {
            "completed".to_owned()
        } else {
            format!("failed: wc status {}", wc.status)
        };
        if !wc.ok() {
            r.failed.get_or_insert(format!(
                "KV write of page {idx} failed (status {})",
                wc.status
            ));
        }
        if self.engine.core().auditing()
            && let (Some(res), Some(&sent)) = (&r.reservation, r.sent.get(idx))
        {
            let dst = res.pages.get(idx).copied().unwrap_or_default();
            let ev = audit::Event::Transfer {
                ts_ns: audit::mono_now_ns(),
                transfer: wc.wr_id,
                request: origin,
                tenant: r.tenant.clone(),
                src_node: self.opts.node_id,
                src_page: sent.page,
                src_generation: sent.generation,
                dst_node: self.decode_node,
                dst_page: dst.page,
                dst_generation: dst.generation,
                bytes: sent.bytes,
                checksum: sent.checksum,
                outcome,
                rkey: sent.rkey,
                remote_addr: sent.remote_addr,
                remote_len: sent.remote_len,
                wire_bytes: sent.wire_bytes,
                work_requests: sent.work_requests,
            };
            self.engine.record(ev);
        }
        let Some(r) = self.reqs.get(&origin) else {
            return;
        };
        if r.outstanding == 0 {
            let result = match (&r.failed, r.first_token) {
                (Some(e), _) => Err(e.as_str().into()),
                (None, Some(t)) => Ok(t),
                (None, None) => Err("no first token".into()),
            };
            self.finish(origin, result);
        }
    }

    /// The transfer is over (every write completed or failed): release prefill's pages, report.
    fn finish(&mut self, id: RequestId, result: TransferResult) {
        let Some(mut r) = self.reqs.remove(&id) else {
            return;
        };
        let (result, kind) = match result {
            Ok(t) => match r.machine.on(ReqEvent::AllVerified) {
                Ok(_) => (
                    Ok(t),
                    RequestKind::Finished {
                        reason: "handed_off".into(),
                    },
                ),
                Err(e) => {
                    let _ = r.machine.end(ReqEvent::Fail);
                    let reason = format!("request {id}: {e}");
                    (Err(reason.as_str().into()), RequestKind::Failed { reason })
                }
            },
            Err(e) => {
                let reason = if r.machine.is_terminal() {
                    e.0.clone() // already failed on an illegal transition: its reason as it is
                } else {
                    let _ = r.machine.end(ReqEvent::Fail);
                    format!("transfer: {e}")
                };
                (Err(e), RequestKind::Failed { reason })
            }
        };
        self.engine.release_held(id, kind);
        if let Some(done) = r.done.take() {
            let _ = done.send(result);
        }
    }

    /// Fail request `id` on an illegal protocol transition: the client gets the transition as
    /// the error, the `requests` row says `failed` with it as the reason, and the pages are
    /// released once no write of them is in flight.
    fn fail_illegal(&mut self, id: RequestId, e: IllegalTransition) {
        tracing::error!(request = id, error = %e, "illegal protocol transition: request failed");
        let reason = format!("request {id}: {e}");
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        let _ = r.machine.end(ReqEvent::Fail);
        r.failed.get_or_insert(reason.clone());
        if r.outstanding == 0 {
            self.finish(id, Err(reason.into()));
        }
    }

    fn abort(&mut self, id: RequestId, reason: &str) {
        let Some(r) = self.reqs.get(&id) else { return };
        if r.outstanding > 0 {
            // Writes are in flight: the pages they read stay held until they complete (a NIC
            // may still be reading them); mark the request so its completion only cleans up.
            if let Some(r) = self.reqs.get_mut(&id) {
                r.failed.get_or_insert(format!("aborted: {reason}"));
                r.done = None;
            }
            return;
        }
        if let Some(mut r) = self.reqs.remove(&id)
            && let Err(e) = r.machine.end(ReqEvent::Abort)
        {
            tracing::error!(request = id, error = %e, "illegal abort transition");
        }
        self.engine.abort(id, reason);
    }

    fn step(&mut self) -> bool {
        let mut busy = false;
        if self.engine.has_work() {
            busy = true;
            for ev in self.engine.step() {
                match ev {
                    Event::Prefilled {
                        id,
                        first_token,
                        cached_tokens,
                    } => {
                        let checksums = self.checksums(id);
                        if let Some(r) = self.reqs.get_mut(&id) {
                            r.first_token = Some(first_token);
                            if let Some(tx) = r.prefilled.take() {
                                let _ = tx.send(Ok(Prefilled { cached_tokens }));
                            }
                            r.checksums = checksums;
                            if r.reservation.is_some() {
                                self.post(id);
                            }
                        } else {
                            let kind = RequestKind::Aborted {
                                reason: "client_disconnected".into(),
                            };
                            self.engine.release_held(id, kind);
                        }
                    }
                    Event::Failed { id, error } => {
                        if let Some(mut r) = self.reqs.remove(&id) {
                            let e = format!("integrity check failed in prefill: {error}");
                            if let Some(tx) = r.prefilled.take() {
                                let _ = tx.send(Err(e.as_str().into()));
                            }
                            if let Some(done) = r.done.take() {
                                let _ = done.send(Err(e.into()));
                            }
                        }
                    }
                    Event::Aborted { id, reason } => {
                        if let Some(mut r) = self.reqs.remove(&id) {
                            if let Some(tx) = r.prefilled.take() {
                                let _ = tx.send(Err(reason.as_str().into()));
                            }
                            if let Some(done) = r.done.take() {
                                let _ = done.send(Err(reason.into()));
                            }
                        }
                    }
                    Event::Token { .. } | Event::Finished { .. } => {}
                }
            }
        }
        let mut wcs = Vec::new();
        if self.transport.poll_send(&mut wcs, 1024).is_ok() {
            busy |= !wcs.is_empty();
            for wc in wcs {
                self.on_completion(wc);
            }
        }
        busy
    }

    /// A lost transport connection is re-established (its outstanding writes were flushed in
    /// error, so nothing is "in flight" on the old one).
    fn maybe_reconnect(&mut self) {
        if self.transport.connected() || self.last_reconnect.elapsed() < Duration::from_millis(50) {
            return;
        }
        self.last_reconnect = Instant::now();
        match self.reconnect() {
            Ok(peer) => {
                self.reconnects += 1;
                tracing::warn!(peer = %peer, "KV transport reconnected");
            }
            Err(e) => tracing::warn!(error = %e, "KV transport reconnect failed"),
        }
    }

    /// A fresh handshake (both transports: `verbs` must exchange new queue-pair endpoints, and
    /// `tcp` learns the address anew), then connect. Blocks this thread for one round trip.
    fn reconnect(&mut self) -> Result<String, ReconnectError> {
        self.transport.reset()?;
        let mut info = self.control.info.clone();
        info.transport_addr = self.transport.endpoint();
        let mut decode = self.control.decode.clone();
        let reply = self
            .control
            .rt
            .block_on(async move {
                tokio::time::timeout(Duration::from_secs(5), decode.handshake(info)).await
            })
            .map_err(|_| ReconnectError::Timeout)?
            .map_err(|s| ReconnectError::Refused(s.message().to_owned()))?
            .into_inner();
        super::check_pair(&self.control.info, &reply)?;
        self.transport
            .connect_peer(&reply.transport_addr, &super::pairing_of(&reply)?)?;
        Ok(reply.transport_addr)
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Stats(tx) => {
                let _ = tx.send(PrefillStats {
                    pool_pages: self.engine.core().pool().n_pages(),
                    free_pages: self.engine.core().pool().n_free(),
                    live_requests: self.engine.n_live(),
                    transfers_in_flight: self.reqs.values().map(|r| r.outstanding).sum(),
                    reconnects: self.reconnects,
                });
            }
            Cmd::Submit(req, front, tx, prefilled) => {
                let _ = tx.send(self.submit(req, front, prefilled));
            }
            Cmd::Attach(id, res, tx) => self.attach(id, res, tx),
            Cmd::Abort(id, reason) => self.abort(id, &reason),
            #[cfg(feature = "fault-injection")]
            Cmd::Fault(f) => self.fault.arm(f, &mut *self.transport),
        }
    }
}

/// How long the engine thread may sleep while writes are in flight: the transport's
/// completions arrive on a channel this thread polls (no reactor wakes it).
const COMPLETION_POLL: Duration = Duration::from_micros(500);
/// How often a lost transport connection is redialled.
const RECONNECT_INTERVAL: Duration = Duration::from_millis(50);

impl actor::Actor for Node {
    type Cmd = Cmd;
    /// Its clients and its decode node are gone: nothing is left to serve.
    const FINISH_WORK_ON_CLOSE: bool = false;

    fn handle(&mut self, cmd: Cmd) -> actor::Control {
        Node::handle(self, cmd);
        actor::Control::Continue
    }

    fn work(&mut self) -> actor::Work {
        let busy = self.step();
        self.maybe_reconnect();
        if busy {
            actor::Work::Busy
        } else if !self.transport.connected() {
            actor::Work::PollAfter(RECONNECT_INTERVAL)
        } else if self.reqs.values().any(|r| r.outstanding > 0) {
            actor::Work::PollAfter(COMPLETION_POLL)
        } else {
            actor::Work::Idle
        }
    }
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cmd::Submit(..) => "Submit",
            Cmd::Attach(..) => "Attach",
            Cmd::Abort(..) => "Abort",
            #[cfg(feature = "fault-injection")]
            Cmd::Fault(..) => "Fault",
            Cmd::Stats(..) => "Stats",
        })
    }
}

/// Commands waiting for the engine thread (bounded: a full queue answers `unavailable`).
const CMD_QUEUE_CMDS: usize = 1024;

/// A running prefill node: its engine thread, and a control-plane client of its decode node.
#[derive(Clone, Debug)]
pub struct PrefillHandle {
    tx: Mailbox<Cmd>,
    decode: DecodeClient<Channel>,
    opts: PrefillOptions,
    relays: Arc<Relays>,
    /// Held by every handle: the checkpoint exchange stops when the last one is gone.
    _alive: Arc<()>,
    pub info: proto::NodeInfo,
    pub decode_info: proto::NodeInfo,
}

/// Why the prefill node could not start.
#[derive(Debug, thiserror::Error)]
pub enum PrefillStartError {
    #[error("cannot reach the decode node's control plane at {addr}: {source}")]
    Connect {
        addr: String,
        source: crate::tls::ChannelError,
    },
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error("handshake refused: {0}")]
    Handshake(String),
    #[error(transparent)]
    Pair(#[from] super::PairMismatch),
    #[error("cannot connect the KV transport to {addr}: {source}")]
    Transport {
        addr: String,
        source: TransportError,
    },
    #[error("cannot start the prefill engine thread: {0}")]
    Thread(#[from] std::io::Error),
}

impl PrefillHandle {
    /// Connect to the decode node (`decode_control` = `http://host:port`), run the handshake on
    /// both sides, connect the KV transport, and start the engine thread. `engine` (idle) takes
    /// the prefill role.
    pub async fn start(
        engine: Engine,
        opts: PrefillOptions,
        security: &Security,
        decode_control: &str,
    ) -> Result<Self, PrefillStartError> {
        let engine = PrefillEngine::new(engine);
        let channel = security
            .channel(decode_control, Role::Decode)
            .await
            .map_err(|source| PrefillStartError::Connect {
                addr: decode_control.to_owned(),
                source,
            })?;
        let mut decode = DecodeClient::new(channel);
        let mut transport = crate::transport::open_initiator(
            opts.node_id,
            &opts.transport_kind,
            opts.kv_encryption.clone(),
        )
        .map_err(|source| PrefillStartError::Transport {
            addr: String::new(),
            source,
        })?;
        let info = super::node_info(
            engine.core().model(),
            &opts.fingerprint,
            opts.node_id,
            "prefill",
            engine.core().pool().page_size(),
            engine.core().context_length(),
            engine.core().pool().n_pages() * engine.core().pool().page_size(),
            transport.kind(),
            String::new(),
            &opts.unsafe_.names(),
        );
        let info = proto::NodeInfo {
            transport_encryption: opts.kv_encryption.is_on(),
            ..info
        };
        let mut hello = info.clone();
        hello.transport_addr = transport.endpoint();
        let decode_info = decode
            .handshake(hello)
            .await
            .map_err(|s| PrefillStartError::Handshake(s.message().to_owned()))?
            .into_inner();
        super::check_pair(&info, &decode_info)?;
        // The decode node's certificate named the identity this node expects (the TLS
        // handshake checked its DNS name); the node id it states must be that identity's.
        if let Security::Tls(t) = security {
            let expected = t.peer(Role::Decode)?;
            if decode_info.node_id != expected.node {
                return Err(PrefillStartError::Handshake(format!(
                    "the decode node states node {} but its certificate is {expected}",
                    decode_info.node_id
                )));
            }
        }
        let pairing =
            super::pairing_of(&decode_info).map_err(|source| PrefillStartError::Transport {
                addr: decode_info.transport_addr.clone(),
                source,
            })?;
        transport
            .connect_peer(&decode_info.transport_addr, &pairing)
            .map_err(|source| PrefillStartError::Transport {
                addr: decode_info.transport_addr.clone(),
                source,
            })?;
        let headers = HeaderArena(
            vec![[0u8; crate::kv::TRANSFER_HDR_BYTES]; engine.core().pool().n_pages()]
                .into_boxed_slice(),
        );
        let register = |t: &mut Box<dyn KvTransport>, p: *const u8, len: usize| {
            // SAFETY: the pool's K/V storage and the header arena are allocated once and
            // never move or shrink; both live in the node, which owns the transport and drops
            // it first (field order).
            unsafe { t.register_source(p, len) }.map_err(|source| PrefillStartError::Transport {
                addr: decode_info.transport_addr.clone(),
                source,
            })
        };
        {
            for region in engine.core().pool().source_regions() {
                register(&mut transport, region.addr, region.len_bytes)?;
            }
            let h = &headers.0;
            register(
                &mut transport,
                h.as_ptr().cast(),
                std::mem::size_of_val(&**h),
            )?;
        }
        let peer = decode_info.transport_addr.clone();
        let node = Node {
            transport,
            engine,
            headers,
            opts: opts.clone(),
            decode_node: decode_info.node_id,
            reqs: HashMap::new(),
            control: Reconnect {
                rt: tokio::runtime::Handle::current(),
                decode: decode.clone(),
                info: info.clone(),
            },
            last_reconnect: Instant::now(),
            reconnects: 0,
            #[cfg(feature = "fault-injection")]
            fault: faults::FaultState::default(),
        };
        let (tx, _join) = actor::spawn(
            "prefill-engine",
            node,
            ActorLimits::with_queue(CMD_QUEUE_CMDS),
        )?;
        tracing::info!(decode = decode_info.node_id, transport = %peer, "prefill node paired with decode node");
        let alive = Arc::new(());
        if let Some(p) = &opts.checkpoints {
            tokio::spawn(crate::checkpoints::exchange_loop(
                decode.clone(),
                p.book.clone(),
                p.interval,
                Arc::downgrade(&alive),
            ));
        }
        Ok(Self {
            tx,
            decode,
            opts,
            relays: Arc::default(),
            _alive: alive,
            info,
            decode_info,
        })
    }

    fn send(&self, cmd: Cmd) -> Result<(), Status> {
        match self.tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(MailboxError::Full { .. }) => {
                Err(Status::unavailable("prefill node command queue full"))
            }
            Err(MailboxError::Stopped(_)) => Err(Status::unavailable("prefill engine stopped")),
        }
    }

    /// Counters (blocking).
    pub fn stats_blocking(&self) -> Option<PrefillStats> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Stats(tx)).ok()?;
        rx.blocking_recv().ok()
    }

    /// Fault injection (feature `fault-injection`, tests only).
    #[cfg(feature = "fault-injection")]
    pub fn fault_inject(&self, f: PrefillFault) {
        let _ = self.send(Cmd::Fault(f));
    }

    /// Run one request through the pair. Tokens (the first from prefill, then decode's) are sent
    /// to `out` as they come; returns when the request ended.
    pub async fn generate(
        &self,
        req: GenerateRequest,
        front: Option<NodeIdentity>,
        out: mpsc::Sender<Result<proto::TokenEvent, Status>>,
    ) {
        if let Err(s) = self.generate_inner(req, front, &out).await {
            let _ = out.send(Err(s)).await;
        }
    }

    async fn generate_inner(
        &self,
        req: GenerateRequest,
        front: Option<NodeIdentity>,
        out: &mpsc::Sender<Result<proto::TokenEvent, Status>>,
    ) -> Result<(), Status> {
        let t0 = Instant::now();
        let original = req.clone();
        // 1. Admission on prefill (over-length: rejected here, nothing allocated anywhere).
        let (tx, rx) = oneshot::channel();
        let (ptx, prx) = oneshot::channel();
        self.send(Cmd::Submit(req, front, tx, ptx))?;
        let (id, _truncated) = rx
            .await
            .map_err(|_| Status::unavailable("prefill engine stopped"))??;
        // 2. Compute the prompt's KV. (Decode pages are reserved only after: they are held for
        //    the transfer and the decode, not for prefill's queueing and compute.)
        let cached_tokens = match prx.await {
            Ok(Ok(p)) => p.cached_tokens as u32,
            Ok(Err(e)) => return Err(Status::aborted(format!("prefill failed: {e}"))),
            Err(_) => {
                let _ = self.send(Cmd::Abort(id, "prefill engine stopped".into()));
                return Err(Status::unavailable("prefill engine stopped"));
            }
        };
        // 3. Reserve on decode, with the prompt as the client sent it (decode runs its own
        //    admission).
        let mut decode = self.decode.clone();
        let reserve = proto::ReserveRequest {
            origin_request: id,
            origin_node: self.opts.node_id,
            tenant: original.tenant.clone(),
            prompt: original.prompt.clone(),
            max_tokens: original.max_tokens as u32,
            sampling: Some(super::sampling_to_proto(&original.sampling)),
            stop_ids: original.stop_ids.clone(),
        };
        let res = loop {
            match decode.reserve(reserve.clone()).await {
                Ok(r) => break r.into_inner(),
                Err(s)
                    if s.code() == tonic::Code::ResourceExhausted
                        && t0.elapsed() < self.opts.reserve_wait =>
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(s) => {
                    let reason = format!("decode reservation failed: {}", s.message());
                    let _ = self.send(Cmd::Abort(id, reason));
                    return Err(s);
                }
            }
        };
        let decode_id = res.request;
        self.relays.lock().insert(id, decode_id);
        let _relay = RelayEntry {
            relays: self.relays.clone(),
            id,
        };
        // 4. Transfer; wait for every write to complete.
        let (tx, rx) = oneshot::channel();
        if let Err(s) = self.send(Cmd::Attach(id, res, tx)) {
            let _ = decode
                .abort(abort_req(decode_id, "prefill queue full"))
                .await;
            return Err(s);
        }
        let first = match rx.await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                let _ = decode.abort(abort_req(decode_id, &e.0)).await;
                return Err(Status::unavailable(format!("KV transfer failed: {e}")));
            }
            Err(_) => {
                let _ = decode
                    .abort(abort_req(decode_id, "prefill engine stopped"))
                    .await;
                return Err(Status::unavailable("prefill engine stopped"));
            }
        };
        // 5. The first token is prefill's. If it ends the request, decode never starts.
        let stop = original.stop_ids.contains(&first);
        if stop || original.max_tokens <= 1 {
            // Decode never starts: its row says how the client saw the end.
            let ended = proto::AbortRequest {
                request: decode_id,
                reason: "finished at the first token".into(),
                finish_reason: if stop { "stop".into() } else { "length".into() },
                delivered_tokens: Some(u32::from(!stop)),
            };
            let _ = decode.abort(ended).await;
            let _ = out
                .send(Ok(proto::TokenEvent {
                    finish_reason: if stop { "stop".into() } else { "length".into() },
                    prompt_tokens: original.prompt.len() as u32,
                    generated_tokens: u32::from(!stop),
                    token: if stop { 0 } else { first },
                    request: id,
                    cached_tokens,
                    ..Default::default()
                }))
                .await;
            return Ok(());
        }
        if out
            .send(Ok(proto::TokenEvent {
                token: first,
                request: id,
                cached_tokens,
                ..Default::default()
            }))
            .await
            .is_err()
        {
            let _ = decode.abort(abort_req(decode_id, "client went away")).await;
            return Ok(());
        }
        // 6. Hand off and relay.
        let mut stream = decode
            .commit(proto::CommitRequest {
                request: decode_id,
                first_token: first,
            })
            .await?
            .into_inner();
        while let Some(mut item) = stream.next().await {
            let end = match &mut item {
                Ok(ev) => {
                    // Decode's events carry decode's id; the client knows this node's.
                    ev.request = id;
                    !ev.finish_reason.is_empty() || !ev.error.is_empty()
                }
                Err(_) => true,
            };
            if out.send(item).await.is_err() {
                // Client gone: dropping the stream tells decode, which aborts the request.
                return Ok(());
            }
            if end {
                break;
            }
        }
        Ok(())
    }

    /// The front ended request `e.request` (this node's id) early: decode records the end as
    /// the front's client saw it. Returns whether decode still had the request (a request that
    /// ended on its own first is recorded as it ended).
    pub async fn end(&self, e: proto::EndRequest) -> Result<bool, Status> {
        let Some(decode_id) = self.relays.lock().get(&e.request).copied() else {
            return Ok(false);
        };
        let reason = if e.reason.is_empty() && e.finish_reason.is_empty() {
            "ended by the front".to_owned()
        } else {
            e.reason
        };
        let ended = proto::AbortRequest {
            request: decode_id,
            reason,
            finish_reason: e.finish_reason,
            delivered_tokens: e.delivered_tokens,
        };
        Ok(self.decode.clone().abort(ended).await?.into_inner().existed)
    }

    /// The gRPC front-door service over this handle.
    pub fn service(&self) -> PrefillService {
        PrefillService { h: self.clone() }
    }
}

fn abort_req(request: u64, reason: &str) -> proto::AbortRequest {
    proto::AbortRequest {
        request,
        reason: reason.to_owned(),
        finish_reason: String::new(),
        delivered_tokens: None,
    }
}

/// The `Prefill` gRPC service (the front door).
#[derive(Debug, Clone)]
pub struct PrefillService {
    h: PrefillHandle,
}

type TokenStream = Pin<Box<dyn Stream<Item = Result<proto::TokenEvent, Status>> + Send>>;

#[tonic::async_trait]
impl prefill_server::Prefill for PrefillService {
    type GenerateStream = TokenStream;

    async fn generate(
        &self,
        r: Request<proto::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let front = r.extensions().get::<crate::tls::Caller>().map(|c| c.0);
        let g = r.into_inner();
        let salt = (!g.cache_salt.is_empty()).then_some(g.cache_salt.as_str());
        let cache = self
            .h
            .opts
            .namespaces
            .as_ref()
            .map(|n| n.scope(&g.tenant, salt, &g.prompt));
        let req = GenerateRequest {
            prompt: g.prompt,
            max_tokens: g.max_tokens as usize,
            sampling: super::sampling_from_proto(g.sampling.as_ref()),
            stop_ids: g.stop_ids,
            tenant: g.tenant,
            cache,
        };
        // Bounded by what the request can produce; the relay awaits a slow client (its own
        // task), never the engine thread.
        let (tx, rx) = mpsc::channel(super::token_relay_capacity_events(req.max_tokens));
        let h = self.h.clone();
        tokio::spawn(async move { h.generate(req, front, tx).await });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn info(
        &self,
        _r: Request<proto::InfoRequest>,
    ) -> Result<Response<proto::NodeInfo>, Status> {
        Ok(Response::new(self.h.info.clone()))
    }

    async fn end(
        &self,
        r: Request<proto::EndRequest>,
    ) -> Result<Response<proto::AbortReply>, Status> {
        let existed = self.h.end(r.into_inner()).await?;
        Ok(Response::new(proto::AbortReply { existed }))
    }
}

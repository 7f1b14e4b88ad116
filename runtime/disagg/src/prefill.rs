//! The prefill node: the front door. Admits, reserves on decode, computes the prompt's KV,
//! writes it into decode's pages over the KV transport, hands the request off, relays tokens.
//!
//! One engine thread owns the engine, its pool and the transport's initiator side; per-request
//! async tasks (gRPC `Generate`) drive the protocol against the decode node's gRPC service.

use crate::transport::Discard;
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
    /// The constraint compiler over the model's vocabulary (`None`: constrained requests are
    /// refused with a message saying so).
    pub grammars: Option<Arc<custody_engine::grammar::Grammars>>,
    /// Set by the node's signal handler: new requests are refused (retryable: nothing posted).
    pub drain: super::Drain,
    /// This node's log, for tenants' promises and proofs (`None`: no audit log).
    pub proofs: Option<Arc<dyn crate::proofs::NodeProofs>>,
    /// `[audit] require_cosignatures`: new work refused while the log lacks them.
    pub gate: Option<Arc<dyn crate::proofs::AuditGate>>,
}

/// One decode node this prefill node writes into (a fleet names several).
#[derive(Clone, Debug)]
pub struct DecodeTarget {
    /// Its control plane, `http://host:port`.
    pub url: String,
    /// The identity its certificate (and its handshake's node id) must name; `None` on the
    /// insecure loopback mode.
    pub identity: Option<NodeIdentity>,
    /// TLS on the KV transport's connection to it (must match the decode node's).
    pub kv_encryption: crate::transport::KvEncryption,
}

/// What the node knows of one decode peer, shared with the gRPC side: its node id and epoch
/// from the last accepted handshake, and whether the KV transport to it is connected now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerLink {
    pub node: u32,
    pub epoch: u64,
    pub connected: bool,
}

/// The peers' links by peer index (written only by the engine thread).
type PeerTable = Arc<std::sync::RwLock<Vec<PeerLink>>>;

/// The requests a front may still end early, by this node's request id: the decode peer and the
/// decode request each was reserved as. An entry lives while its `generate` runs (bounded by the live requests).
#[derive(Debug, Default)]
struct Relays(std::sync::Mutex<HashMap<RequestId, (usize, u64)>>);

impl Relays {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, (usize, u64)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The decode peer and request of this node's most recent requests, ended or not: where a
/// front that ended a request itself finds decode's promise of it.
#[derive(Debug, Default)]
struct RecentRelays(std::sync::Mutex<std::collections::VecDeque<(RequestId, usize, u64)>>);

/// Requests [`RecentRelays`] remembers (a front asks right after it answered).
const RECENT_RELAYS: usize = 4096;

impl RecentRelays {
    fn remember(&self, id: RequestId, peer: usize, decode_id: u64) {
        let mut q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() == RECENT_RELAYS {
            q.pop_front();
        }
        q.push_back((id, peer, decode_id));
    }

    fn find(&self, id: RequestId) -> Option<(usize, u64)> {
        let q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        q.iter()
            .rev()
            .find(|(i, _, _)| *i == id)
            .map(|&(_, peer, decode_id)| (peer, decode_id))
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
#[error("{reason}")]
pub struct TransferFailed {
    pub reason: String,
    /// It failed before any write of it was posted (a router may retry it elsewhere).
    pub nothing_posted: bool,
}

impl TransferFailed {
    /// A failure before any write was posted.
    fn before_posting(reason: String) -> Self {
        Self {
            reason,
            nothing_posted: true,
        }
    }
}

impl From<String> for TransferFailed {
    fn from(reason: String) -> Self {
        Self {
            reason,
            nothing_posted: false,
        }
    }
}

impl From<&str> for TransferFailed {
    fn from(s: &str) -> Self {
        s.to_owned().into()
    }
}

/// How a request's transfer ended, as seen by prefill: the first token, or why not.
type TransferResult = Result<u32, TransferFailed>;

/// A prompt's KV is computed (its first token travels with the transfer's result): how many
/// of its tokens came from the prefix cache.
#[derive(Clone, Debug)]
struct Prefilled {
    cached_tokens: usize,
    /// The first token's log-probabilities, when the request asked for them.
    first_logprobs: Option<Box<crate::engine_decoding::TokenLogprobs>>,
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
    #[error("decode node unreachable: {0}")]
    Unreachable(String),
    #[error(transparent)]
    Pair(#[from] super::PairMismatch),
}

impl ReconnectError {
    fn of_status(s: &Status) -> Self {
        if s.code() == tonic::Code::Unavailable {
            Self::Unreachable(s.message().to_owned())
        } else {
            Self::Refused(s.message().to_owned())
        }
    }
}

/// The `node_events` kind that names, for each admitted request, the authenticated front that
/// asserted its tenant (`request=<id> tenant=<tenant> front=custody-node:front:<n>`).
pub const FRONT_REQUEST_EVENT: &str = "front_request";

/// The `node_events` kind that binds a request to the router's route (`request=<id>
/// transfer=<router's transfer id> router=<n> prefill=<n> decode=<n> epoch=<e> attempt=<a>`).
pub const ROUTE_EVENT: &str = "route";

/// A route's `node_events` detail, the same fields on both nodes (`request` is the recording
/// node's own request id).
pub fn route_detail(request: u64, r: &proto::Route) -> String {
    format!(
        "request={request} transfer={} router={} prefill={} decode={} epoch={} attempt={}",
        r.transfer_id, r.router_node, r.prefill_node, r.decode_node, r.decode_epoch, r.attempt
    )
}

/// Decode's reservation for a submitted request, on peer `peer`, made while that peer was at
/// `epoch`.
struct Attachment {
    id: RequestId,
    peer: usize,
    epoch: u64,
    reservation: proto::ReserveReply,
}

/// A prompt to admit, from an authenticated front (and, in a fleet, its router's route).
struct Submission {
    req: GenerateRequest,
    front: Option<NodeIdentity>,
    route: Option<proto::Route>,
}

enum Cmd {
    /// Admit a prompt (prefill-only). Replies with the prefill request id and whether the
    /// (legacy) path truncated it; `prefilled` fires when its KV is computed (first token).
    Submit(
        Box<Submission>,
        oneshot::Sender<Result<(RequestId, bool), Status>>,
        oneshot::Sender<PrefillResult>,
    ),
    /// Decode's reservation (on peer `peer`) for a submitted request; the reply fires when the
    /// transfer is over.
    Attach(Box<Attachment>, oneshot::Sender<TransferResult>),
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
    /// Pages the prefix cache keeps (evictable when not held by a request).
    pub cached_pages: usize,
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
    /// The decode peer written into (index into `Node::peers`) and its node id; set at attach.
    peer: usize,
    decode_node: u32,
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

/// One decode peer: the KV transport to it (its own connection and pairing) and its control
/// plane.
struct Peer {
    /// Declared (so dropped) before the memory registered with it: the engine's pool and the
    /// header arena (fields of [`Node`] after `peers`).
    transport: Box<dyn KvTransport>,
    target: DecodeTarget,
    decode: DecodeClient<Channel>,
    /// The last accepted handshake reply (node id, epoch); `None` until paired and while
    /// re-pairing.
    paired: Option<proto::NodeInfo>,
    /// Its node id from the first accepted handshake (0 before): kept while it re-pairs (a
    /// peer's certificate, hence its node id, does not change).
    node_id: u32,
    /// A handshake is in flight (its result comes through `Node::handshakes`).
    handshaking: bool,
    last_attempt: Instant,
    backoff: Duration,
}

/// A background handshake's result, for the engine thread.
struct HandshakeDone {
    peer: usize,
    result: Result<proto::NodeInfo, ReconnectError>,
}

struct Node {
    /// Declared (so dropped) before the memory registered with their transports: the engine's
    /// pool and the header arena.
    peers: Vec<Peer>,
    engine: PrefillEngine,
    headers: HeaderArena,
    opts: PrefillOptions,
    reqs: HashMap<RequestId, PReq>,
    /// This node's handshake statement (its transport address is each peer's own).
    info: proto::NodeInfo,
    rt: tokio::runtime::Handle,
    handshakes: (
        std::sync::mpsc::Sender<HandshakeDone>,
        std::sync::mpsc::Receiver<HandshakeDone>,
    ),
    table: PeerTable,
    reconnects: u64,
    /// Faults armed by tests (feature `fault-injection`; not compiled into a binary).
    #[cfg(feature = "fault-injection")]
    fault: faults::FaultState,
}

impl Node {
    fn submit(
        &mut self,
        sub: Submission,
        prefilled: oneshot::Sender<PrefillResult>,
    ) -> Result<(RequestId, bool), Status> {
        let Submission {
            mut req,
            front,
            route,
        } = sub;
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
        if let Some(route) = &route {
            // Which route of the router's this request is (its transfer id joins the logs).
            self.engine.record(audit::Event::Node {
                ts_ns: audit::mono_now_ns(),
                kind: ROUTE_EVENT.into(),
                detail: route_detail(id, route),
            });
        }
        self.reqs.insert(
            id,
            PReq {
                machine: ReqMachine::new(),
                tenant,
                peer: 0,
                decode_node: 0,
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

    fn attach(&mut self, a: Attachment, done: oneshot::Sender<TransferResult>) {
        let Attachment {
            id,
            peer,
            epoch,
            reservation,
        } = a;
        let (decode_node, paired_epoch) = self.peers.get(peer).map_or((0, None), |p| {
            (p.node_id, p.paired.as_ref().map(|i| i.epoch))
        });
        let Some(r) = self.reqs.get_mut(&id) else {
            done.send(Err(format!("prefill request {id} is gone").into()))
                .discard("the asker went away before its answer");
            return;
        };
        r.peer = peer;
        r.decode_node = decode_node;
        r.done = Some(done);
        if decode_node == 0 || paired_epoch != Some(epoch) {
            // The reservation was made at another epoch of the peer (it restarted, or is being
            // re-paired): its key belongs to a pairing this node no longer holds. Nothing is
            // posted under it; release and report (retryable).
            let why = format!(
                "decode node {decode_node} is at epoch {paired_epoch:?} now, the reservation was made at epoch {epoch}"
            );
            self.finish(id, Err(TransferFailed::before_posting(why)));
            return;
        }
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        r.reservation = Some(reservation);
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
        // No grant (not held, or its tags moved): nothing precomputed; `post` mints its own
        // grant and fails the request with the reason.
        let Some(Ok(grant)) = self.engine.send_grant(id) else {
            return Vec::new();
        };
        let pool = self.engine.core().pool();
        let mut out = Vec::with_capacity(grant.pages().len());
        for (idx, g) in grant.pages().iter().enumerate() {
            match pool.transfer_checksum(&grant, idx) {
                Ok(sum) => out.push((g.page().page, g.slots(), sum)),
                // The same grant is minted again at the post, which then fails the request.
                Err(_) => return Vec::new(),
            }
        }
        out
    }

    /// Post the writes of every prompt page of `id` (called when both the KV and the
    /// reservation are there).
    fn post(&mut self, id: RequestId) {
        let grant = match self.engine.send_grant(id) {
            Some(Ok(g)) => g,
            Some(Err(e)) => {
                self.finish(
                    id,
                    Err(format!("the prompt's pages cannot be sent: {e}").into()),
                );
                return;
            }
            None => {
                self.finish(id, Err("prefill pages are gone".into()));
                return;
            }
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
        let n_pages = grant.pages().len();
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
        let peer = r.peer;
        let Some(transport) = self.peers.get_mut(peer).map(|p| &mut p.transport) else {
            return;
        };
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
        for (idx, g) in grant.pages().iter().enumerate() {
            let (pr, slots) = (g.page(), g.slots());
            let mut bytes = 0u64;
            let checksum = pool
                .transfer_chunks(&grant, idx, |_, b| bytes += b.len() as u64)
                .and_then(|()| match r.checksums.get(idx) {
                    Some(&(page, s, c)) if page == pr.page && s == slots => Ok(c),
                    _ => pool.transfer_checksum(&grant, idx),
                });
            let checksum = match checksum {
                Ok(c) => c,
                Err(e) => {
                    error = Some(format!("page {idx} of the prompt cannot be sent: {e}"));
                    break;
                }
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
            let chain = super::page_write_chain(
                pool,
                &grant,
                idx,
                page_base,
                res.rkey,
                transfer_id(id, idx),
                imm_of(res.imm_slot, idx),
                &header[..],
            );
            let (sges, wrs) = match chain {
                Ok(c) => c,
                Err(e) => {
                    error = Some(format!("page {idx} of the prompt cannot be sent: {e}"));
                    break;
                }
            };
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
        // A page that could not be gathered stops the transfer before anything is posted.
        debug_assert!(error.is_some() || chains.len() == n_pages);
        let n_ready = if error.is_some() { 0 } else { chains.len() };
        let mut first = 0;
        while first < n_ready {
            // The group: pages first..end, at least one, at most POST_WRS_MAX requests.
            let end = super::link_post_group(&mut chains, first);
            #[cfg(feature = "fault-injection")]
            if let Some(x) = extra
                && (first..end).contains(&x.page_index)
            {
                faults::post_unrecorded_copy(&mut **transport, &chains[x.page_index], x, res.rkey);
            }
            // SAFETY: every SGE points into this node's pool pages (held, not written until
            // released after the completion) or into the page's header slot (see
            // `HeaderArena`), both registered with the transport at start; the linked chains
            // live in `chains` (their heap buffers do not move) for the duration of the call.
            let res_post = unsafe { transport.post_write(&chains[first].1[0]) };
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
                dst_node: r.decode_node,
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
                    r.machine.fail();
                    let reason = format!("request {id}: {e}");
                    (Err(reason.as_str().into()), RequestKind::Failed { reason })
                }
            },
            Err(e) => {
                let reason = if r.machine.is_terminal() {
                    e.reason.clone() // already failed on an illegal transition: its reason as it is
                } else {
                    r.machine.fail();
                    format!("transfer: {e}")
                };
                (Err(e), RequestKind::Failed { reason })
            }
        };
        self.engine.release_held(id, kind);
        if let Some(done) = r.done.take() {
            done.send(result)
                .discard("the asker went away before its answer");
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
        r.machine.fail();
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
                        first_logprobs,
                        ..
                    } => {
                        let checksums = self.checksums(id);
                        if let Some(r) = self.reqs.get_mut(&id) {
                            r.first_token = Some(first_token);
                            if let Some(tx) = r.prefilled.take() {
                                tx.send(Ok(Prefilled {
                                    cached_tokens,
                                    first_logprobs,
                                }))
                                .discard(
                                    "the front went away; its request ends through the abort path",
                                );
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
                                tx.send(Err(e.as_str().into())).discard(
                                    "the front went away; its request ends through the abort path",
                                );
                            }
                            if let Some(done) = r.done.take() {
                                done.send(Err(e.into()))
                                    .discard("the asker went away before its answer");
                            }
                        }
                    }
                    Event::Aborted { id, reason } => {
                        if let Some(mut r) = self.reqs.remove(&id) {
                            if let Some(tx) = r.prefilled.take() {
                                tx.send(Err(reason.as_str().into())).discard(
                                    "the front went away; its request ends through the abort path",
                                );
                            }
                            if let Some(done) = r.done.take() {
                                done.send(Err(reason.into()))
                                    .discard("the asker went away before its answer");
                            }
                        }
                    }
                    Event::Token { .. } | Event::Finished { .. } => {}
                }
            }
        }
        let mut wcs = Vec::new();
        for peer in &mut self.peers {
            // wr_ids are this node's (request << 16 | page index): unique across peers.
            match peer.transport.poll_send(&mut wcs, 1024) {
                // Not connected (yet, or any more): `maybe_reconnect` pairs it again, and a lost
                // connection's writes complete with errors through the retired queues above.
                Ok(_) | Err(TransportError::NotConnected) => {}
                Err(e) => {
                    tracing::error!(peer = peer.node_id, error = %e, "polling KV write completions failed")
                }
            }
        }
        busy |= !wcs.is_empty();
        for wc in wcs {
            self.on_completion(wc);
        }
        busy
    }

    /// A peer whose transport connection was lost, or that was never paired, gets a fresh
    /// handshake once none of its writes is outstanding (their error completions are polled
    /// first), with doubling pauses. The handshake runs in the background, so a dead or
    /// unreachable decode node does not stall this thread (and every other peer's transfers);
    /// the KV connect that follows an answered handshake runs here, bounded by the transport's
    /// connect and proof timeout (5 s) — a node whose control plane answers but whose KV port
    /// does not costs up to that per attempt.
    fn maybe_reconnect(&mut self) {
        while let Ok(done) = self.handshakes.1.try_recv() {
            self.handshake_done(done);
        }
        let now = Instant::now();
        // A peer with writes still outstanding is not reset: their (error) completions must be
        // polled first, or the requests would wait for them forever (verbs discards what a reset
        // queue pair has not completed; tcp completes them at the loss).
        let mut writing = vec![false; self.peers.len()];
        for r in self.reqs.values().filter(|r| r.outstanding > 0) {
            if let Some(w) = writing.get_mut(r.peer) {
                *w = true;
            }
        }
        for idx in 0..self.peers.len() {
            let p = &mut self.peers[idx];
            let down = p.paired.is_none() || !p.transport.connected();
            if !down
                || writing[idx]
                || p.handshaking
                || now.duration_since(p.last_attempt) < p.backoff
            {
                continue;
            }
            p.last_attempt = now;
            p.handshaking = true;
            if p.paired.take().is_some() {
                tracing::warn!(peer = idx, url = %p.target.url, "KV transport to a decode node lost: re-pairing");
            }
            if let Err(e) = p.transport.reset() {
                tracing::warn!(error = %e, "KV transport reset failed");
            }
            let mut hello = self.info.clone();
            hello.transport_addr = p.transport.endpoint();
            let mut decode = p.decode.clone();
            let tx = self.handshakes.0.clone();
            self.rt.spawn(async move {
                let result =
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, decode.handshake(hello)).await {
                        Err(_) => Err(ReconnectError::Timeout),
                        Ok(Err(s)) => Err(ReconnectError::of_status(&s)),
                        Ok(Ok(r)) => Ok(r.into_inner()),
                    };
                tx.send(HandshakeDone { peer: idx, result })
                    .discard("the engine thread stopped: nothing is left to pair");
            });
        }
        self.publish_links();
    }

    fn handshake_done(&mut self, done: HandshakeDone) {
        let info = self.info.clone();
        let Some(p) = self.peers.get_mut(done.peer) else {
            return;
        };
        p.handshaking = false;
        match done.result.and_then(|reply| pair_with(p, &info, reply)) {
            Ok(()) => {
                p.backoff = RECONNECT_INTERVAL;
                self.reconnects += 1;
                tracing::warn!(peer = %p.target.url, "KV transport to a decode node (re)paired");
            }
            Err(e) => {
                p.backoff = (p.backoff * 2).min(RECONNECT_MAX);
                tracing::warn!(peer = %p.target.url, error = %e, retry_in_ms = p.backoff.as_millis() as u64, "pairing with a decode node failed");
            }
        }
    }

    /// The peers' links as the gRPC side and the load report see them (written on change; a
    /// read and no allocation otherwise — this runs at every unit of work).
    fn publish_links(&self) {
        let changed = {
            let t = self.table.read().unwrap_or_else(|p| p.into_inner());
            t.len() != self.peers.len() || t.iter().zip(&self.peers).any(|(l, p)| *l != p.link())
        };
        if changed {
            *self.table.write().unwrap_or_else(|p| p.into_inner()) =
                self.peers.iter().map(Peer::link).collect();
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Stats(tx) => {
                tx.send(PrefillStats {
                    pool_pages: self.engine.core().pool().n_pages(),
                    free_pages: self.engine.core().pool().n_free(),
                    live_requests: self.engine.n_live(),
                    transfers_in_flight: self.reqs.values().map(|r| r.outstanding).sum(),
                    reconnects: self.reconnects,
                    cached_pages: self
                        .engine
                        .core()
                        .prefix_cache_stats()
                        .map_or(0, |c| c.entries),
                })
                .discard("the asker went away before its answer");
            }
            Cmd::Submit(sub, tx, prefilled) => {
                tx.send(self.submit(*sub, prefilled))
                    .discard("the asker went away before its answer");
            }
            Cmd::Attach(a, tx) => self.attach(*a, tx),
            Cmd::Abort(id, reason) => self.abort(id, &reason),
            #[cfg(feature = "fault-injection")]
            Cmd::Fault(f) => {
                // Test faults act on the first peer's transport (the pair tests have one).
                if let Some(p) = self.peers.first_mut() {
                    self.fault.arm(f, &mut *p.transport);
                }
            }
        }
    }
}

/// How long the engine thread may sleep while writes are in flight: the transport's
/// completions arrive on a channel this thread polls (no reactor wakes it).
const COMPLETION_POLL: Duration = Duration::from_micros(500);
/// How often a lost transport connection is redialled at first (doubling up to RECONNECT_MAX).
const RECONNECT_INTERVAL: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// A background handshake that takes longer than this failed.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

impl Peer {
    fn link(&self) -> PeerLink {
        match &self.paired {
            Some(i) => PeerLink {
                node: i.node_id,
                epoch: i.epoch,
                connected: self.transport.connected(),
            },
            None => PeerLink::default(),
        }
    }
}

/// Check a decode node's handshake reply against this node's statement and the peer's expected
/// identity, then connect the KV transport with the pairing it carries.
fn pair_with(
    p: &mut Peer,
    own: &proto::NodeInfo,
    reply: proto::NodeInfo,
) -> Result<(), ReconnectError> {
    super::check_pair(own, &reply)?;
    // The decode node's certificate named the identity this node expects (the TLS handshake
    // checked its DNS name); the node id it states must be that identity's.
    if let Some(id) = p.target.identity
        && reply.node_id != id.node
    {
        return Err(ReconnectError::Refused(format!(
            "the decode node states node {} but its certificate is {id}",
            reply.node_id
        )));
    }
    p.transport
        .connect_peer(&reply.transport_addr, &super::pairing_of(&reply)?)?;
    p.node_id = reply.node_id;
    p.paired = Some(reply);
    Ok(())
}

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
        } else if self
            .peers
            .iter()
            .any(|p| p.paired.is_none() || !p.transport.connected())
        {
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

/// A running prefill node: its engine thread, and a control-plane client of each decode peer.
#[derive(Clone, Debug)]
pub struct PrefillHandle {
    tx: Mailbox<Cmd>,
    /// By peer index (the same as the engine thread's).
    decodes: Arc<[DecodeClient<Channel>]>,
    table: PeerTable,
    opts: PrefillOptions,
    relays: Arc<Relays>,
    recent: Arc<RecentRelays>,
    /// Held by every handle: the checkpoint exchange stops when the last one is gone.
    _alive: Arc<()>,
    pub info: proto::NodeInfo,
    /// The first decode peer's handshake reply at start (default when it was not reachable).
    pub decode_info: proto::NodeInfo,
    /// The model's vocabulary size (decoding options are checked against it).
    vocab: usize,
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
    #[error("no decode node to write into")]
    NoPeers,
    #[error("cannot start the prefill engine thread: {0}")]
    Thread(#[from] std::io::Error),
}

impl From<ReconnectError> for PrefillStartError {
    fn from(e: ReconnectError) -> Self {
        match e {
            ReconnectError::Pair(p) => Self::Pair(p),
            ReconnectError::Transport(source) => Self::Transport {
                addr: String::new(),
                source,
            },
            ReconnectError::Timeout => Self::Handshake("handshake timed out".into()),
            ReconnectError::Refused(m) | ReconnectError::Unreachable(m) => Self::Handshake(m),
        }
    }
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
        let channel = security
            .channel(decode_control, Role::Decode)
            .await
            .map_err(|source| PrefillStartError::Connect {
                addr: decode_control.to_owned(),
                source,
            })?;
        let identity = match security {
            Security::Tls(t) => Some(t.peer(Role::Decode)?),
            Security::InsecureLoopback => None,
        };
        let target = DecodeTarget {
            url: decode_control.to_owned(),
            identity,
            kv_encryption: opts.kv_encryption.clone(),
        };
        Self::start_with(
            engine,
            opts,
            vec![(target, DecodeClient::new(channel))],
            true,
        )
        .await
    }

    /// A fleet's prefill node: every decode node in `targets`, each verified by its own
    /// identity. A refused handshake (model, geometry, identity) stops the start; a peer that is
    /// unreachable now is paired in the background when it answers.
    pub async fn start_fleet(
        engine: Engine,
        opts: PrefillOptions,
        security: &Security,
        targets: Vec<DecodeTarget>,
    ) -> Result<Self, PrefillStartError> {
        let mut peers = Vec::with_capacity(targets.len());
        for t in targets {
            let channel = match t.identity {
                Some(id) => security.channel_lazy(&t.url, id),
                None => {
                    security.check_url(&t.url)?;
                    tonic::transport::Endpoint::from_shared(t.url.clone())
                        .map(|e| e.connect_lazy())
                        .map_err(crate::tls::ChannelError::from)
                }
            }
            .map_err(|source| PrefillStartError::Connect {
                addr: t.url.clone(),
                source,
            })?;
            peers.push((t, DecodeClient::new(channel)));
        }
        Self::start_with(engine, opts, peers, false).await
    }

    async fn start_with(
        engine: Engine,
        opts: PrefillOptions,
        targets: Vec<(DecodeTarget, DecodeClient<Channel>)>,
        all_required: bool,
    ) -> Result<Self, PrefillStartError> {
        if targets.is_empty() {
            return Err(PrefillStartError::NoPeers);
        }
        let engine = PrefillEngine::new(engine);
        let vocab = engine.core().model().config.vocab_size;
        let info = super::node_info(
            engine.core().model(),
            &opts.fingerprint,
            opts.node_id,
            "prefill",
            engine.core().pool().geometry(),
            engine.core().context_length(),
            engine.core().pool().n_pages() * engine.core().pool().page_size(),
            opts.transport_kind.name(),
            String::new(),
            &opts.unsafe_.names(),
        );
        let info = proto::NodeInfo {
            transport_encryption: opts.kv_encryption.is_on(),
            epoch: super::draw_epoch().map_err(|source| PrefillStartError::Transport {
                addr: String::new(),
                source,
            })?,
            ..info
        };
        let headers = HeaderArena(
            vec![[0u8; crate::kv::TRANSFER_HDR_BYTES]; engine.core().pool().n_pages()]
                .into_boxed_slice(),
        );
        let mut peers = Vec::with_capacity(targets.len());
        let mut decode_info = proto::NodeInfo::default();
        for (idx, (target, decode)) in targets.into_iter().enumerate() {
            let mut p = open_peer(&engine, &headers, &opts, target, decode)?;
            match first_handshake(&mut p, &info).await {
                Ok(()) => {}
                // Unreachable now: paired in the background when it answers.
                Err(
                    e @ (ReconnectError::Timeout
                    | ReconnectError::Transport(_)
                    | ReconnectError::Unreachable(_)),
                ) if !all_required => {
                    tracing::warn!(peer = %p.target.url, error = %e, "decode node not reachable at start: pairing in the background");
                }
                Err(e) => return Err(e.into()),
            }
            if idx == 0 {
                decode_info = p.paired.clone().unwrap_or_default();
            }
            peers.push(p);
        }
        let decodes: Arc<[DecodeClient<Channel>]> =
            peers.iter().map(|p| p.decode.clone()).collect();
        let table: PeerTable = Arc::new(std::sync::RwLock::new(
            peers.iter().map(Peer::link).collect(),
        ));
        for p in &peers {
            if let Some(i) = &p.paired {
                tracing::info!(decode = i.node_id, transport = %i.transport_addr, epoch = i.epoch, "prefill node paired with decode node");
            }
        }
        let node = Node {
            peers,
            engine,
            headers,
            opts: opts.clone(),
            reqs: HashMap::new(),
            info: info.clone(),
            rt: tokio::runtime::Handle::current(),
            handshakes: std::sync::mpsc::channel(),
            table: table.clone(),
            reconnects: 0,
            #[cfg(feature = "fault-injection")]
            fault: faults::FaultState::default(),
        };
        let (tx, _join) = actor::spawn(
            "prefill-engine",
            node,
            ActorLimits::with_queue(CMD_QUEUE_CMDS),
        )?;
        let alive = Arc::new(());
        if let Some(p) = &opts.checkpoints {
            for decode in decodes.iter() {
                tokio::spawn(crate::checkpoints::exchange_loop(
                    decode.clone(),
                    p.book.clone(),
                    p.interval,
                    Arc::downgrade(&alive),
                ));
            }
        }
        Ok(Self {
            tx,
            decodes,
            table,
            opts,
            relays: Arc::default(),
            recent: Arc::default(),
            _alive: alive,
            info,
            decode_info,
            vocab,
        })
    }

    /// The decode peers as the engine thread last saw them (node id, epoch, connected).
    pub fn peer_links(&self) -> Vec<PeerLink> {
        self.table.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Requests whose tokens this node still relays from a decode node.
    pub fn relaying(&self) -> usize {
        self.relays.lock().len()
    }

    /// Whether the node is draining (refusing new requests).
    pub fn draining(&self) -> bool {
        self.opts.drain.is_draining()
    }

    /// The peer a request is written into: the route's decode node, if this node is paired
    /// with it at the route's epoch; without a route, the only (or the first connected) peer.
    fn choose_peer(&self, route: Option<&proto::Route>) -> Result<(usize, u64), Status> {
        let links = self.peer_links();
        let Some(route) = route else {
            // No router: the first connected peer, else the first (a peer re-pairing after a
            // lost connection is back within a reconnect interval; a post before fails cleanly).
            let i = links.iter().position(|l| l.connected).unwrap_or(0);
            return Ok((i, links.get(i).map_or(0, |l| l.epoch)));
        };
        if route.prefill_node != self.opts.node_id {
            return Err(Status::invalid_argument(format!(
                "the route names prefill node {}, this is node {}",
                route.prefill_node, self.opts.node_id
            )));
        }
        match links.iter().position(|l| l.node == route.decode_node) {
            Some(i) if links[i].epoch == route.decode_epoch && links[i].connected => {
                Ok((i, route.decode_epoch))
            }
            Some(i) => Err(super::nothing_posted(Status::unavailable(format!(
                "decode node {} is at epoch {} (connected: {}), the route names epoch {}",
                route.decode_node, links[i].epoch, links[i].connected, route.decode_epoch
            )))),
            None => Err(super::nothing_posted(Status::unavailable(format!(
                "decode node {} is not paired with this prefill node",
                route.decode_node
            )))),
        }
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

    /// Counters.
    pub async fn stats(&self) -> Option<PrefillStats> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Stats(tx)).ok()?;
        rx.await.ok()
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
        self.send(Cmd::Fault(f))
            .discard("fault injection on a stopped engine has nothing to inject into");
    }

    /// Run one request through the pair. Tokens (the first from prefill, then decode's) are sent
    /// to `out` as they come; returns when the request ended.
    pub async fn generate(
        &self,
        req: GenerateRequest,
        front: Option<NodeIdentity>,
        route: Option<proto::Route>,
        out: mpsc::Sender<Result<proto::TokenEvent, Status>>,
    ) {
        if let Err(s) = self.generate_inner(req, front, route, &out).await {
            out.send(Err(s))
                .await
                .discard("the client went away before the error reached it");
        }
    }

    /// Steps 1–3 (admission, prefill, reservation) post nothing: each failure there is
    /// returned marked [`super::nothing_posted`], the only kind a router may retry elsewhere.
    async fn generate_inner(
        &self,
        req: GenerateRequest,
        front: Option<NodeIdentity>,
        route: Option<proto::Route>,
        out: &mpsc::Sender<Result<proto::TokenEvent, Status>>,
    ) -> Result<(), Status> {
        let t0 = Instant::now();
        if self.draining() {
            return Err(super::nothing_posted(Status::unavailable(
                "this prefill node is draining",
            )));
        }
        crate::proofs::refused(self.opts.gate.as_ref())?;
        let (peer, epoch) = self.choose_peer(route.as_ref())?;
        let routed = route.is_some();
        let original = req.clone();
        // 1. Admission on prefill (over-length: rejected here, nothing allocated anywhere).
        let (tx, rx) = oneshot::channel();
        let (ptx, prx) = oneshot::channel();
        let sub = Submission { req, front, route };
        self.send(Cmd::Submit(Box::new(sub), tx, ptx))
            .map_err(super::nothing_posted)?;
        let (id, _truncated) = rx
            .await
            .map_err(|_| Status::unavailable("prefill engine stopped"))
            .and_then(|r| r)
            .map_err(super::nothing_posted)?;
        // 2. Compute the prompt's KV. (Decode pages are reserved only after: they are held for
        //    the transfer and the decode, not for prefill's queueing and compute.)
        let (cached_tokens, first_logprobs) = match prx.await {
            Ok(Ok(p)) => (
                p.cached_tokens as u32,
                p.first_logprobs.as_deref().map(super::logprobs_to_proto),
            ),
            Ok(Err(e)) => {
                return Err(super::nothing_posted(Status::aborted(format!(
                    "prefill failed: {e}"
                ))));
            }
            Err(_) => {
                self.send(Cmd::Abort(id, "prefill engine stopped".into()))
                    .discard("a stopped engine has aborted every request already");
                return Err(super::nothing_posted(Status::unavailable(
                    "prefill engine stopped",
                )));
            }
        };
        // 3. Reserve on decode, with the prompt as the client sent it (decode runs its own
        //    admission).
        let mut decode = self.decodes[peer].clone();
        let reserve = proto::ReserveRequest {
            origin_request: id,
            origin_node: self.opts.node_id,
            tenant: original.tenant.clone(),
            prompt: original.prompt.clone(),
            max_tokens: original.max_tokens as u32,
            sampling: Some(super::sampling_to_proto(&original.sampling)),
            stop_ids: original.stop_ids.clone(),
            route,
            decoding: Some(super::decoding_to_proto(&original.decoding)),
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
                    self.send(Cmd::Abort(id, reason))
                        .discard("a stopped engine has aborted every request already");
                    return Err(super::nothing_posted(s));
                }
            }
        };
        let decode_id = res.request;
        self.relays.lock().insert(id, (peer, decode_id));
        self.recent.remember(id, peer, decode_id);
        let _relay = RelayEntry {
            relays: self.relays.clone(),
            id,
        };
        // 4. Transfer; wait for every write to complete.
        let (tx, rx) = oneshot::channel();
        let attachment = Attachment {
            id,
            peer,
            epoch,
            reservation: res,
        };
        if let Err(s) = self.send(Cmd::Attach(Box::new(attachment), tx)) {
            decode
                .abort(abort_req(decode_id, "prefill queue full"))
                .await.discard("decode ends an unanswered reservation by its lease; the abort only shortens it");
            return Err(s);
        }
        let first = match rx.await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                decode.abort(abort_req(decode_id, &e.reason)).await.discard("decode ends an unanswered reservation by its lease; the abort only shortens it");
                let s = Status::unavailable(format!("KV transfer failed: {e}"));
                return Err(if e.nothing_posted {
                    super::nothing_posted(s)
                } else {
                    s
                });
            }
            Err(_) => {
                decode
                    .abort(abort_req(decode_id, "prefill engine stopped"))
                    .await.discard("decode ends an unanswered reservation by its lease; the abort only shortens it");
                return Err(Status::unavailable("prefill engine stopped"));
            }
        };
        tracing::debug!(
            request = id,
            routed,
            to_first_token_us = t0.elapsed().as_micros() as u64,
            "transferred"
        );
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
            decode.abort(ended).await.discard(
                "decode ends an unanswered reservation by its lease; the abort only shortens it",
            );
            let promises = self
                .promises(&original.tenant, id, Some((peer, decode_id)))
                .await;
            out.send(Ok(proto::TokenEvent {
                promises,
                finish_reason: if stop { "stop".into() } else { "length".into() },
                prompt_tokens: original.prompt.len() as u32,
                generated_tokens: u32::from(!stop),
                token: if stop { 0 } else { first },
                request: id,
                cached_tokens,
                logprobs: if stop { None } else { first_logprobs },
                ..Default::default()
            }))
            .await
            .discard("the client went away before the error reached it");
            return Ok(());
        }
        if out
            .send(Ok(proto::TokenEvent {
                token: first,
                request: id,
                cached_tokens,
                logprobs: first_logprobs,
                ..Default::default()
            }))
            .await
            .is_err()
        {
            decode.abort(abort_req(decode_id, "client went away")).await.discard("decode ends an unanswered reservation by its lease; the abort only shortens it");
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
                    if !ev.finish_reason.is_empty() {
                        let (tenant, peer) = (&original.tenant, peer);
                        ev.promises = self.promises(tenant, id, Some((peer, decode_id))).await;
                    }
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

    /// The signed promises of a request's records, for its final event: the decode peer's of
    /// its request (`decode`: peer index and its id there), then this node's own of `id`.
    /// Empty when this node keeps no log (a front then says so); a node that cannot promise
    /// says why in its entry.
    async fn promises(
        &self,
        tenant: &str,
        id: RequestId,
        decode: Option<(usize, u64)>,
    ) -> Vec<proto::ReceiptPromise> {
        use crate::proofs::{local, promise_of, promise_request};
        if self.opts.proofs.is_none() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(2);
        if let Some((peer, decode_id)) = decode {
            let node = self.peer_links().get(peer).map_or(0, |l| l.node);
            let asked = self.decodes[peer]
                .clone()
                .proof(promise_request(tenant, node, decode_id))
                .await
                .map(tonic::Response::into_inner);
            out.push(promise_of(node, decode_id, asked));
        }
        let own = self.opts.node_id;
        let asked = local(self.opts.proofs.as_ref(), promise_request(tenant, own, id)).await;
        out.push(promise_of(own, id, asked));
        out
    }

    /// A tenant's proof request from the front: this node's own log, or a decode peer's
    /// (forwarded to it by node id).
    pub async fn proof(&self, req: proto::ProofRequest) -> Result<proto::ProofReply, Status> {
        if req.node == self.opts.node_id && req.what == crate::proofs::PROMISES {
            let decode = self.recent.find(req.request);
            return Ok(proto::ProofReply {
                status: 200,
                body: Vec::new(),
                promises: self.promises(&req.tenant, req.request, decode).await,
            });
        }
        if req.node == self.opts.node_id {
            return crate::proofs::local(self.opts.proofs.as_ref(), req).await;
        }
        let Some(peer) = self.peer_links().iter().position(|l| l.node == req.node) else {
            return Err(Status::not_found(format!(
                "node {} is neither this prefill node nor one of its decode peers",
                req.node
            )));
        };
        Ok(self.decodes[peer].clone().proof(req).await?.into_inner())
    }

    /// The front ended request `e.request` (this node's id) early: decode records the end as
    /// the front's client saw it. Returns whether decode still had the request (a request that
    /// ended on its own first is recorded as it ended).
    pub async fn end(&self, e: proto::EndRequest) -> Result<bool, Status> {
        let Some((peer, decode_id)) = self.relays.lock().get(&e.request).copied() else {
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
        Ok(self.decodes[peer]
            .clone()
            .abort(ended)
            .await?
            .into_inner()
            .existed)
    }

    /// The gRPC front-door service over this handle.
    pub fn service(&self) -> PrefillService {
        PrefillService { h: self.clone() }
    }
}

/// A decode peer's KV transport (the pool and the header arena registered with it) and its
/// control-plane client; not yet paired.
fn open_peer(
    engine: &PrefillEngine,
    headers: &HeaderArena,
    opts: &PrefillOptions,
    target: DecodeTarget,
    decode: DecodeClient<Channel>,
) -> Result<Peer, PrefillStartError> {
    let addr = target.url.clone();
    let err = |source| PrefillStartError::Transport {
        addr: addr.clone(),
        source,
    };
    let mut transport = crate::transport::open_initiator(
        opts.node_id,
        &opts.transport_kind,
        target.kv_encryption.clone(),
    )
    .map_err(err)?;
    for region in engine.core().pool().source_regions() {
        // SAFETY: the pool's K/V storage is allocated once and never moves or shrinks; it
        // lives in the node, which owns the transport and drops it first (field order).
        unsafe { transport.register_source(region.addr, region.len_bytes) }.map_err(err)?;
    }
    let h = &headers.0;
    // SAFETY: the header arena is a boxed slice that never moves; as above for its lifetime.
    unsafe { transport.register_source(h.as_ptr().cast(), std::mem::size_of_val(&**h)) }
        .map_err(err)?;
    Ok(Peer {
        transport,
        target,
        decode,
        paired: None,
        node_id: 0,
        handshaking: false,
        last_attempt: Instant::now(),
        backoff: RECONNECT_INTERVAL,
    })
}

/// The handshake at start, awaited (a refusal stops the start).
async fn first_handshake(p: &mut Peer, info: &proto::NodeInfo) -> Result<(), ReconnectError> {
    let mut hello = info.clone();
    hello.transport_addr = p.transport.endpoint();
    let reply = tokio::time::timeout(HANDSHAKE_TIMEOUT, p.decode.handshake(hello))
        .await
        .map_err(|_| ReconnectError::Timeout)?
        .map_err(|s| ReconnectError::of_status(&s))?
        .into_inner();
    pair_with(p, info, reply)
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
        // Prefill samples the first token: the constraint travels with the request and is
        // compiled here, on the blocking pool.
        let (grammars, vocab, wire) = (self.h.opts.grammars.clone(), self.h.vocab, g.decoding);
        let decoding = tokio::task::spawn_blocking(move || {
            super::decoding_from_proto(wire, vocab, grammars.as_deref())
        })
        .await
        .map_err(|e| Status::internal(format!("constraint compiler task failed: {e}")))??;
        let req = GenerateRequest {
            decoding,
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
        let route = g.route;
        tokio::spawn(async move { h.generate(req, front, route, tx).await });
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

    async fn proof(
        &self,
        r: Request<proto::ProofRequest>,
    ) -> Result<Response<proto::ProofReply>, Status> {
        self.h.proof(r.into_inner()).await.map(Response::new)
    }
}

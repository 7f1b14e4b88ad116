//! Disaggregated prefill/decode: the protocol state machine, the two node roles, their gRPC
//! control plane, and the client of the prefill node's front door.
//!
//! # The flow of one request (see [`protocol`] for the state machine)
//! 1. The prefill node's front door runs admission (over-length prompts are rejected here, before
//!    anything is allocated anywhere) and computes the prompt's KV in its own pool, sampling the
//!    first token (`Prefilling`).
//! 2. It asks the decode node to `Reserve`: decode runs its own admission, allocates the pages
//!    for `prompt + max_tokens`, registers a transport key for exactly those pages, and replies
//!    with the key, the page list and each page's generation (`Reserved`). Reserving only now
//!    keeps decode pages from idling through prefill's queue and compute; a reservation that
//!    makes no progress within its lease is aborted (key invalidated, then pages freed).
//! 3. Prefill posts one chain of one-sided writes per page: the page's filled slots, then an
//!    in-band header (decode's request id and page generation, slot count, checksum) written
//!    with immediate data (`Transferring`).
//! 4. Decode lands the bytes, and on each page's completion verifies the header and checksum;
//!    only then are the slots marked written. When every prompt page verified: `Prefilled`.
//! 5. Prefill, once every write completed, releases its own pages and sends `Commit` with the
//!    first token; decode invalidates the key (no write can land after this) and decodes
//!    (`Decoding`), streaming tokens back through prefill to the client.
//!
//! Any failure or abort ends the request: decode quarantines its pages, invalidates the key, and
//! only then frees them (safety property 2).
// Every result in runtime/ is handled or dropped with its reason (`Discard`), never `let _ =`.
#![deny(clippy::let_underscore_must_use)]

pub mod bench;
pub mod checkpoints;
pub mod client;
pub mod config;
pub mod decode;
pub mod fleet;
pub mod health;
pub mod node;
pub mod prefill;
pub mod proofs;
pub mod tls;
/// The request protocol's state machine (in the engine crate: the engine applies its page rule).
pub use custody_engine::protocol;

/// Re-exported so callers (the binary, tests) use the same gRPC types.
pub use tonic;

/// Generated gRPC types and services (`runtime/disagg/proto/disagg.proto`).
#[allow(clippy::all, missing_debug_implementations, unreachable_pub)]
pub mod proto {
    tonic::include_proto!("custody.disagg.v1");
}

// The engine's and the transport's modules under their own names, so that the nodes read as
// they did inside one crate (`crate::engine::Engine`, `crate::transport::KvTransport`).
use custody_engine::decoding as engine_decoding;
use custody_engine::{actor, engine, kv, model, sampling};
use custody_transport as transport;

use crate::model::Model;
use crate::sampling::SamplingParams;

/// Pages per request the immediate data can address: imm = (slot << 12) | page index.
pub const MAX_PAGES_PER_REQUEST: usize = 1 << 12;
/// Reservation slots (live reservations) the immediate data can address.
pub const MAX_RESERVATIONS: u32 = 1 << 20;

/// Events one request's token relay can carry: at most `max_tokens` tokens, then one terminal
/// event, plus one error — so a sender on the engine thread (`try_send`) never finds it full.
pub fn token_relay_capacity_events(max_tokens: usize) -> usize {
    max_tokens.saturating_add(2)
}

pub fn imm_of(slot: u32, idx: usize) -> u32 {
    debug_assert!(slot < MAX_RESERVATIONS && idx < MAX_PAGES_PER_REQUEST);
    (slot << 12) | idx as u32
}

pub fn imm_split(imm: u32) -> (u32, usize) {
    (imm >> 12, (imm & 0xfff) as usize)
}

/// Transfer id of page `idx` of prefill request `origin`: the same on both nodes' audit rows.
pub fn transfer_id(origin: u64, idx: usize) -> u64 {
    (origin << 16) | idx as u64
}

/// Lands a region's writes in a pool (the decode node's landing, and the transfer benchmark's):
/// region offset `o` of key `k` is page `o / stride` of the reservation `grant_of(k)` at
/// `o % stride`, in the page's region layout (in-band header, then K/V of every layer). Every
/// landing presents the reservation's [`LandGrant`], which the pool checks against the page's
/// tag (owner and generation) before a byte lands. Supports direct landing.
///
/// [`LandGrant`]: crate::kv::LandGrant
pub(crate) struct PoolLanding<'a, F> {
    pub landing: crate::kv::Landing<'a>,
    pub stride: usize,
    pub grant_of: F,
}

/// Where a region offset lands: the reservation's grant, the page index in it, the offset in
/// the page's region layout.
struct Located<'g> {
    grant: &'g crate::kv::LandGrant,
    idx: usize,
    within: usize,
}

fn access(e: crate::kv::LandError) -> crate::transport::AccessError {
    crate::transport::AccessError(e.0)
}

impl<'g, F> PoolLanding<'_, F>
where
    F: Fn(u32) -> Result<&'g crate::kv::LandGrant, crate::transport::AccessError>,
{
    fn locate(&self, rkey: u32, offset: u64) -> Result<Located<'g>, crate::transport::AccessError> {
        Ok(Located {
            grant: (self.grant_of)(rkey)?,
            idx: offset as usize / self.stride,
            within: offset as usize % self.stride,
        })
    }
}

impl<'g, F> crate::transport::TargetMemory for PoolLanding<'_, F>
where
    F: Fn(u32) -> Result<&'g crate::kv::LandGrant, crate::transport::AccessError>,
{
    fn write(
        &mut self,
        rkey: u32,
        offset: u64,
        bytes: &[u8],
    ) -> Result<(), crate::transport::AccessError> {
        let at = self.locate(rkey, offset)?;
        self.landing
            .land(at.grant, at.idx, at.within, bytes)
            .map_err(access)
    }

    fn direct(&self) -> bool {
        true
    }

    fn dest(
        &mut self,
        rkey: u32,
        offset: u64,
        max_len: usize,
    ) -> Result<&mut [u8], crate::transport::AccessError> {
        let at = self.locate(rkey, offset)?;
        // Never past this page's part of the region: the next page is elsewhere in the pool.
        let max_len = max_len.min(self.stride - at.within);
        self.landing
            .land_dest(at.grant, at.idx, at.within, max_len)
            .map_err(access)
    }

    fn dests<'a>(
        &'a mut self,
        rkey: u32,
        offset: u64,
        max_len: usize,
        out: &mut Vec<&'a mut [u8]>,
    ) -> Result<(), crate::transport::AccessError> {
        let at = self.locate(rkey, offset)?;
        let max_len = max_len.min(self.stride - at.within);
        self.landing
            .land_dests(at.grant, at.idx, at.within, max_len, out)
            .map_err(access)
    }

    fn dest_done(
        &mut self,
        rkey: u32,
        offset: u64,
        len: u64,
    ) -> Result<(), crate::transport::AccessError> {
        // Every page whose part of the region the write touched: headers take effect now.
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let at = self.locate(rkey, pos)?;
            let n = ((self.stride - at.within) as u64).min(end - pos);
            self.landing
                .land_done(at.grant, at.idx, at.within, n as usize)
                .map_err(access)?;
            pos += n;
        }
        Ok(())
    }
}

/// What a node states about itself in the handshake.
#[allow(clippy::too_many_arguments)]
pub fn node_info(
    model: &Model,
    fingerprint: &str,
    node_id: u32,
    role: &str,
    geom: custody_engine::kv::PageGeometry,
    context_length: usize,
    pool_tokens: usize,
    transport: &str,
    transport_addr: String,
    unsafe_switches: &[&str],
) -> proto::NodeInfo {
    proto::NodeInfo {
        node_id,
        role: role.into(),
        model_fingerprint: fingerprint.into(),
        page_size: geom.page_size as u32,
        n_layers: model.config.n_layers as u32,
        kv_dim: model.config.kv_dim() as u32,
        // The pool's storage type: a pair whose pools store K/V differently is refused (the
        // bytes of a page would be read as another format).
        kv_dtype: geom.kv.name().into(),
        context_length: context_length as u64,
        pool_tokens: pool_tokens as u64,
        transport: transport.into(),
        transport_addr,
        unsafe_switches: unsafe_switches.iter().map(|s| (*s).to_owned()).collect(),
        transport_encryption: false,
        kv_pairing: None,
        epoch: 0,
    }
}

/// A process's epoch (its incarnation, [`proto::NodeInfo::epoch`]): drawn from the OS CSPRNG at
/// start, never 0 (0 is "unset" on the wire).
pub fn draw_epoch() -> Result<u64, crate::transport::TransportError> {
    Ok(crate::transport::pairing::random_u64()?.max(1))
}

/// The gRPC metadata a node puts on a failed `Generate`/`Reserve` when **no KV write of the
/// attempt was posted** (nothing can have landed anywhere): the only failures a router may
/// retry on another pair. Absent, the request failed closed.
pub const NOTHING_POSTED_KEY: &str = "custody-nothing-posted";

/// `s`, marked as failing before any KV write was posted ([`NOTHING_POSTED_KEY`]).
pub fn nothing_posted(mut s: tonic::Status) -> tonic::Status {
    s.metadata_mut().insert(
        NOTHING_POSTED_KEY,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    s
}

/// Whether `s` says no KV write of the attempt was posted.
pub fn is_nothing_posted(s: &tonic::Status) -> bool {
    s.metadata()
        .get(NOTHING_POSTED_KEY)
        .is_some_and(|v| v.as_bytes() == b"1")
}

/// A node's drain switch, shared by its services and its signal handler: once set, new requests
/// are refused (before anything is reserved: retryable elsewhere), the load report and
/// `/health/ready` say so, and requests already running finish.
#[derive(Clone, Debug, Default)]
pub struct Drain(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drain {
    pub fn start(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    pub fn is_draining(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl std::fmt::Debug for proto::KvPairing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPairing")
            .field("id", &format_args!("{:#018x}", self.id))
            .field(
                "secret",
                &format_args!("<{} bytes, redacted>", self.secret.len()),
            )
            .finish()
    }
}

/// The KV pairing a decode node's handshake reply carries.
pub fn pairing_of(
    reply: &proto::NodeInfo,
) -> Result<crate::transport::Pairing, crate::transport::TransportError> {
    let p = reply.kv_pairing.as_ref().ok_or_else(|| {
        crate::transport::TransportError::Auth(
            "the decode node's handshake carries no KV pairing".into(),
        )
    })?;
    crate::transport::Pairing::from_parts(p.id, &p.secret)
}

/// A prefill/decode pair that must not run together: every difference, so the operator fixes
/// them all at once.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the prefill/decode pair refuses to run: {}", .differences.join("; "))]
pub struct PairMismatch {
    pub differences: Vec<String>,
}

/// The pair's compatibility rule. Every difference is listed, so the operator fixes them all at
/// once.
pub fn check_pair(prefill: &proto::NodeInfo, decode: &proto::NodeInfo) -> Result<(), PairMismatch> {
    let mut bad = Vec::new();
    if prefill.model_fingerprint != decode.model_fingerprint {
        bad.push(format!(
            "model fingerprint differs (prefill {}, decode {})",
            prefill.model_fingerprint, decode.model_fingerprint
        ));
    }
    for (what, a, b) in [
        ("page_size", prefill.page_size, decode.page_size),
        ("n_layers", prefill.n_layers, decode.n_layers),
        ("kv_dim", prefill.kv_dim, decode.kv_dim),
    ] {
        if a != b {
            bad.push(format!("{what} differs (prefill {a}, decode {b})"));
        }
    }
    if prefill.kv_dtype != decode.kv_dtype {
        bad.push(format!(
            "KV dtype differs (prefill {}, decode {})",
            prefill.kv_dtype, decode.kv_dtype
        ));
    }
    if prefill.transport != decode.transport {
        bad.push(format!(
            "KV transport differs (prefill {}, decode {})",
            prefill.transport, decode.transport
        ));
    }
    if prefill.transport_encryption != decode.transport_encryption {
        bad.push(format!(
            "KV transport encryption differs (prefill {}, decode {})",
            prefill.transport_encryption, decode.transport_encryption
        ));
    }
    if prefill.context_length != decode.context_length {
        bad.push(format!(
            "context length differs (prefill {}, decode {})",
            prefill.context_length, decode.context_length
        ));
    }
    for n in [prefill, decode] {
        let skip = n.unsafe_switches.iter().any(|s| s == "skip_pool_check");
        if n.pool_tokens < n.context_length && !skip {
            bad.push(format!(
                "{} node {} pool holds {} tokens, less than one context of {}",
                n.role, n.node_id, n.pool_tokens, n.context_length
            ));
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(PairMismatch { differences: bad })
    }
}

pub(crate) fn sampling_to_proto(s: &SamplingParams) -> proto::Sampling {
    proto::Sampling {
        temperature: s.temperature,
        top_k: s.top_k as u32,
        top_p: s.top_p,
        seed: s.seed,
    }
}

/// A request's decoding options on the wire: the constraint as its kind and text.
pub fn decoding_to_proto(d: &crate::engine_decoding::Decoding) -> proto::Decoding {
    let spec = d.constraint.as_ref().map(|c| c.spec());
    proto::Decoding {
        logit_bias: d
            .logit_bias
            .iter()
            .map(|b| proto::LogitBias {
                token: b.token,
                bias: b.bias,
            })
            .collect(),
        presence_penalty: d.presence_penalty,
        frequency_penalty: d.frequency_penalty,
        logprobs: d.logprobs.map(|k| k as u32),
        constraint_kind: spec.map(|s| s.kind.name().to_owned()).unwrap_or_default(),
        constraint_source: spec.map(|s| s.source.clone()).unwrap_or_default(),
        n: d.n,
    }
}

/// Why a request's decoding options were refused on arrival.
#[derive(Debug, thiserror::Error)]
pub enum DecodingRefused {
    #[error("unknown constraint kind {0:?}")]
    Kind(String),
    #[error(
        "the request is constrained but this node has no constraint compiler (its vocabulary could not be made into one; see its log)"
    )]
    NoCompiler,
    #[error(transparent)]
    Grammar(#[from] custody_engine::grammar::GrammarError),
    #[error(transparent)]
    Options(#[from] crate::engine_decoding::DecodingError),
}

impl From<DecodingRefused> for tonic::Status {
    fn from(e: DecodingRefused) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// The options of `d` (absent: none), checked against a vocabulary of `vocab` tokens, the
/// constraint compiled with `grammars`. Compiling can take a while: call it off the engine
/// thread and the async workers (`spawn_blocking`).
pub fn decoding_from_proto(
    d: Option<proto::Decoding>,
    vocab: usize,
    grammars: Option<&custody_engine::grammar::Grammars>,
) -> Result<crate::engine_decoding::Decoding, DecodingRefused> {
    let Some(d) = d else {
        return Ok(Default::default());
    };
    let constraint = if d.constraint_kind.is_empty() {
        None
    } else {
        let kind = custody_engine::grammar::ConstraintKind::from_name(&d.constraint_kind)
            .ok_or_else(|| DecodingRefused::Kind(d.constraint_kind.clone()))?;
        let g = grammars.ok_or(DecodingRefused::NoCompiler)?;
        Some(g.compile(custody_engine::grammar::ConstraintSpec {
            kind,
            source: d.constraint_source,
        })?)
    };
    let out = crate::engine_decoding::Decoding {
        logit_bias: d
            .logit_bias
            .iter()
            .map(|b| crate::engine_decoding::LogitBias {
                token: b.token,
                bias: b.bias,
            })
            .collect(),
        presence_penalty: d.presence_penalty,
        frequency_penalty: d.frequency_penalty,
        logprobs: d.logprobs.map(|k| k as usize),
        constraint,
        n: d.n,
    };
    out.validate(vocab)?;
    Ok(out)
}

/// A token's log-probabilities on the wire.
pub fn logprobs_to_proto(lp: &crate::engine_decoding::TokenLogprobs) -> proto::TokenLogprobs {
    proto::TokenLogprobs {
        logprob: lp.logprob,
        top: lp
            .top
            .iter()
            .map(|t| proto::TopLogprob {
                token: t.token,
                logprob: t.logprob,
            })
            .collect(),
    }
}

/// A token's log-probabilities off the wire.
pub fn logprobs_from_proto(lp: &proto::TokenLogprobs) -> crate::engine_decoding::TokenLogprobs {
    crate::engine_decoding::TokenLogprobs {
        logprob: lp.logprob,
        top: lp
            .top
            .iter()
            .map(|t| crate::engine_decoding::TopLogprob {
                token: t.token,
                logprob: t.logprob,
            })
            .collect(),
    }
}

pub(crate) fn sampling_from_proto(s: Option<&proto::Sampling>) -> SamplingParams {
    match s {
        Some(s) => SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k as usize,
            top_p: s.top_p,
            seed: s.seed,
        },
        None => SamplingParams::default(),
    }
}

/// Map an admission error to the gRPC status a client sees.
pub(crate) fn admission_status(e: &crate::engine::AdmissionError) -> tonic::Status {
    use crate::engine::AdmissionError as A;
    match e {
        A::Busy { .. } | A::QueueFull { .. } => tonic::Status::resource_exhausted(e.to_string()),
        A::AuditUnavailable(_) => tonic::Status::unavailable(e.to_string()),
        _ => tonic::Status::invalid_argument(e.to_string()),
    }
}

/// Scatter/gather entries per work request (what common RDMA NICs accept: mlx5's RC limit).
pub const MAX_SGE: usize = 30;

/// Work requests per post at most: prefill links consecutive pages' chains into one post of up
/// to this many requests (a whole transfer of the engine's usual 16 pages is one post of 48). One
/// post is one doorbell on a NIC and one probe hit for the eBPF witness instead of one per page;
/// the bound keeps a post well inside a send queue (verbs' default depth is 1,024) and the
/// witness's walk of it inside its chain bound (4,096).
pub const POST_WRS_MAX: usize = 256;

/// The work requests that write granted page `idx` (its granted slots, from `pool`) into a
/// remote region's page at `page_base`, then its in-band `header` with immediate data `imm`:
/// chunks that are contiguous in the remote layout are gathered into one request (up to
/// [`MAX_SGE`] entries), so a full page is a few large writes instead of one per layer. The pool
/// refuses a grant whose page no longer carries the granted tag.
///
/// Returns the SGE storage and the chain (linked through `next`; post `&chain[0]`). Both must
/// stay alive and unmoved until the post returns; the bytes they point to until completion.
#[allow(clippy::too_many_arguments)]
pub fn page_write_chain(
    pool: crate::kv::PoolView<'_>,
    grant: &crate::kv::SendGrant,
    idx: usize,
    page_base: u64,
    rkey: u32,
    wr_id: u64,
    imm: u32,
    header: &[u8],
) -> Result<
    (
        Vec<crate::transport::abi::Sge>,
        Vec<crate::transport::abi::SendWr>,
    ),
    crate::kv::GrantError,
> {
    use crate::transport::abi::{SendWr, Sge};
    let mut sges: Vec<Sge> = Vec::new();
    // (remote offset, first sge, n sges) per work request.
    let mut groups: Vec<(u64, usize, usize)> = Vec::new();
    let mut next_off = u64::MAX;
    pool.transfer_chunks(grant, idx, |off, b| {
        let off = off as u64;
        match groups.last_mut() {
            Some(g) if off == next_off && g.2 < MAX_SGE => g.2 += 1,
            _ => groups.push((off, sges.len(), 1)),
        }
        sges.push(Sge {
            addr: b.as_ptr() as u64,
            length: b.len() as u32,
            lkey: 0,
        });
        next_off = off + b.len() as u64;
    })?;
    sges.push(Sge {
        addr: header.as_ptr() as u64,
        length: header.len() as u32,
        lkey: 0,
    });
    let hdr = sges.len() - 1;
    let mut wrs: Vec<SendWr> = groups
        .iter()
        .map(|&(off, first, n)| {
            SendWr::rdma_write(wr_id, &sges[first..first + n], page_base + off, rkey)
        })
        .collect();
    // The header goes last, with the immediate data: writes on a connection land in order, so
    // its completion means the whole page landed.
    wrs.push(SendWr::rdma_write(wr_id, &sges[hdr..], page_base, rkey).with_imm(imm));
    for i in 0..wrs.len() - 1 {
        let next: *const SendWr = &wrs[i + 1];
        wrs[i].next = next;
    }
    Ok((sges, wrs))
}

/// Link the page chains `chains[first..end]` into one chain of at most [`POST_WRS_MAX`] work
/// requests (always at least the first page's) and return `end`: post `&chains[first].1[0]`.
/// The chains' heap buffers must not move until that post returns.
pub fn link_post_group(
    chains: &mut [(
        Vec<crate::transport::abi::Sge>,
        Vec<crate::transport::abi::SendWr>,
    )],
    first: usize,
) -> usize {
    use crate::transport::abi::SendWr;
    assert!(first < chains.len() && !chains[first].1.is_empty());
    let mut end = first + 1;
    let mut n_wrs = chains[first].1.len();
    while end < chains.len() && n_wrs + chains[end].1.len() <= POST_WRS_MAX {
        n_wrs += chains[end].1.len();
        end += 1;
    }
    for k in first..end - 1 {
        let next: *const SendWr = chains[k + 1].1.as_ptr();
        if let Some(last) = chains[k].1.last_mut() {
            last.next = next;
        }
    }
    if let Some(last) = chains[end - 1].1.last_mut() {
        last.next = std::ptr::null();
    }
    debug_assert!(end > first && (end - first == 1 || n_wrs <= POST_WRS_MAX));
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages' chains are linked into posts of at most POST_WRS_MAX requests, each whole page in
    /// one post, the last request of a post ending the chain; a page longer than the bound goes
    /// alone.
    #[test]
    fn pages_are_posted_in_linked_groups_within_the_bound() {
        use crate::transport::abi::{SendWr, Sge};
        let sge = [Sge::default()];
        let page = |n: usize| -> (Vec<Sge>, Vec<SendWr>) {
            let mut wrs: Vec<SendWr> = (0..n)
                .map(|i| SendWr::rdma_write(i as u64, &sge, 0, 1))
                .collect();
            for i in 0..n - 1 {
                let next: *const SendWr = &wrs[i + 1];
                wrs[i].next = next;
            }
            (sge.to_vec(), wrs)
        };
        let walk = |first: &SendWr| {
            let mut n = 0;
            let mut w: *const SendWr = first;
            while !w.is_null() {
                n += 1;
                // SAFETY: the chains live in `chains` for the walk.
                w = unsafe { (*w).next };
            }
            n
        };
        // 100 three-request pages, one page longer than the bound, 10 more pages.
        let mut chains: Vec<_> = (0..111).map(|_| page(3)).collect();
        chains[100] = page(POST_WRS_MAX + 1);
        let mut first = 0;
        let mut groups = Vec::new();
        while first < chains.len() {
            let end = link_post_group(&mut chains, first);
            let n_wrs: usize = chains[first..end].iter().map(|c| c.1.len()).sum();
            assert_eq!(walk(&chains[first].1[0]), n_wrs, "the group is one chain");
            groups.push((first, end, n_wrs));
            first = end;
        }
        assert_eq!(
            groups,
            [
                (0, 85, 255),
                (85, 100, 45),
                (100, 101, POST_WRS_MAX + 1),
                (101, 111, 30)
            ]
        );
    }

    fn info(role: &str, pool: u64) -> proto::NodeInfo {
        proto::NodeInfo {
            node_id: 1,
            role: role.into(),
            model_fingerprint: "ab".into(),
            page_size: 16,
            n_layers: 30,
            kv_dim: 192,
            kv_dtype: "f16".into(),
            context_length: 2048,
            pool_tokens: pool,
            transport: "tcp".into(),
            transport_addr: String::new(),
            unsafe_switches: Vec::new(),
            transport_encryption: false,
            kv_pairing: None,
            epoch: 0,
        }
    }

    #[test]
    fn a_handshake_reply_never_shows_its_pairing_secret() {
        let mut reply = info("decode", 4096);
        reply.kv_pairing = Some(proto::KvPairing {
            id: 7,
            secret: vec![0xAB; 32],
        });
        let shown = format!("{reply:?}");
        assert!(
            shown.contains("redacted") && !shown.contains("171"),
            "{shown}"
        );
        let p = pairing_of(&reply).expect("pairing");
        assert_eq!(p.secret(), &[0xAB; 32]);
    }

    #[test]
    fn pair_check_lists_every_mismatch() {
        assert!(check_pair(&info("prefill", 4096), &info("decode", 4096)).is_ok());
        let mut d = info("decode", 1024);
        d.page_size = 32;
        d.model_fingerprint = "cd".into();
        d.transport = "verbs".into();
        d.transport_encryption = true;
        d.kv_dtype = "q8_0".into();
        let e = check_pair(&info("prefill", 4096), &d)
            .expect_err("mismatch")
            .to_string();
        assert!(
            e.contains("KV dtype differs (prefill f16, decode q8_0)")
                && e.contains("fingerprint")
                && e.contains("KV transport encryption differs")
                && e.contains("KV transport differs")
                && e.contains("page_size")
                && e.contains("less than one context"),
            "{e}"
        );
        d = info("decode", 1024);
        d.unsafe_switches.push("skip_pool_check".into());
        assert!(check_pair(&info("prefill", 4096), &d).is_ok());
    }

    #[test]
    fn imm_round_trips() {
        assert_eq!(imm_split(imm_of(77, 4095)), (77, 4095));
        assert_eq!(
            imm_split(imm_of(MAX_RESERVATIONS - 1, 0)),
            (MAX_RESERVATIONS - 1, 0)
        );
    }
}

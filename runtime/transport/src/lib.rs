//! KV transfer transports with one-sided-write semantics (RDMA-write style).
//!
//! # Spec
//! - The **target** (the decode node) registers a region of `len` bytes and gets a key (`rkey`)
//!   and a base address; the initiator addresses bytes as `base + offset` with that key.
//! - The **initiator** (the prefill node) posts chains of work requests ([`abi::SendWr`]): each
//!   gathers local bytes ([`abi::Sge`]) and writes them contiguously at a remote address. Writes
//!   on one connection land in order. The last write of a unit carries immediate data and is
//!   signaled: the initiator gets a send completion once it landed (or failed: bad key, out of
//!   range, lost connection), the target a receive completion with the immediate data.
//! - **Invalidate** (`flush`): after [`KvTransport::invalidate`] returns, no write with that key
//!   lands — later arrivals fail with `REM_ACCESS_ERR` on the initiator. This is the proof the
//!   decode node needs before it returns a quarantined page to the free list (safety property 2).
//! - Landing is explicit: the target's bytes are written only inside [`KvTransport::poll_recv`],
//!   through the [`TargetMemory`] the caller lends — the software analogue of a NIC's DMA into a
//!   registered region, done by the thread that owns the memory (no shared mutable pool).
//! - Every transport calls the probe points of [`abi`] with the exact structures it uses.
// Every result in runtime/ is handled or dropped with its reason (`Discard`), never `let _ =`.
#![deny(clippy::let_underscore_must_use)]

/// The probe ABI (its own dependency-free crate, which the eBPF witness compiles against too).
pub use custody_probe_abi as abi;
pub mod pairing;
pub mod tcp;
#[cfg(feature = "rdma")]
pub mod verbs;

pub use pairing::Pairing;
pub use tcp::KvEncryption;

use abi::{SendWr, Wc};

/// Which transport a node uses (both nodes of a pair must agree; the handshake checks).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TransportKind {
    /// Software one-sided writes over TCP: works everywhere.
    #[default]
    Tcp,
    /// RDMA through libibverbs (build feature `rdma`); `device` = e.g. `mlx5_0`, `None` = first.
    Verbs { device: Option<String> },
}

impl TransportKind {
    /// Parse the configuration's `transport` (`"tcp"` or `"verbs"`) and `verbs_device`.
    pub fn parse(name: &str, device: Option<&str>) -> Result<Self, TransportError> {
        match name {
            "tcp" => Ok(Self::Tcp),
            "verbs" => Ok(Self::Verbs {
                device: device.map(str::to_owned),
            }),
            other => Err(TransportError::BadEndpoint(format!(
                "unknown transport {other:?} (expected \"tcp\" or \"verbs\")"
            ))),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Verbs { .. } => "verbs",
        }
    }
}

/// Open the transport of a target (decode node): `tcp` listens on `listen`; `verbs` opens the
/// device (its endpoint is exchanged in the handshake). `encryption`: TLS on every `tcp`
/// connection ([`KvEncryption::Server`]), or [`KvEncryption::Off`].
pub fn open_target(
    node: u32,
    kind: &TransportKind,
    listen: std::net::SocketAddr,
    encryption: KvEncryption,
) -> Result<Box<dyn KvTransport>, TransportError> {
    match kind {
        TransportKind::Tcp => {
            let mut t = tcp::TcpTransport::new(node);
            t.set_encryption(encryption)?;
            t.listen(listen)?;
            Ok(Box::new(t))
        }
        TransportKind::Verbs { device } => {
            refuse_verbs_encryption(&encryption)?;
            open_verbs(node, device.as_deref())
        }
    }
}

/// Open the transport of an initiator (prefill node); it connects in the handshake.
/// `encryption`: TLS to the target ([`KvEncryption::Client`]), or [`KvEncryption::Off`].
pub fn open_initiator(
    node: u32,
    kind: &TransportKind,
    encryption: KvEncryption,
) -> Result<Box<dyn KvTransport>, TransportError> {
    match kind {
        TransportKind::Tcp => {
            let mut t = tcp::TcpTransport::new(node);
            t.set_encryption(encryption)?;
            Ok(Box::new(t))
        }
        TransportKind::Verbs { device } => {
            refuse_verbs_encryption(&encryption)?;
            open_verbs(node, device.as_deref())
        }
    }
}

/// Verbs writes are placed by the NIC: there is no stream to wrap in TLS (encryption on an RDMA
/// fabric is the NIC's or the link's — IPsec/MACsec offload — not this process's).
fn refuse_verbs_encryption(e: &KvEncryption) -> Result<(), TransportError> {
    match e {
        KvEncryption::Off => Ok(()),
        _ => Err(TransportError::Unsupported {
            transport: "verbs",
            what: "transport_encryption (RDMA writes bypass this process; use the fabric's \
                   IPsec/MACsec offload)",
        }),
    }
}

#[cfg(feature = "rdma")]
fn open_verbs(node: u32, device: Option<&str>) -> Result<Box<dyn KvTransport>, TransportError> {
    Ok(Box::new(verbs::VerbsTransport::open(node, device)?))
}

#[cfg(not(feature = "rdma"))]
fn open_verbs(_node: u32, _device: Option<&str>) -> Result<Box<dyn KvTransport>, TransportError> {
    Err(TransportError::Unsupported {
        transport: "verbs",
        what: "this build has no RDMA support (rebuild with `--features rdma`)",
    })
}

/// A registered region: `rkey` and the base address writes are addressed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub rkey: u32,
    pub base: u64,
    pub len: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("transport I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("not connected to a target")]
    NotConnected,
    #[error("the connection to the peer was lost")]
    Disconnected,
    #[error("unknown key {0:#x}")]
    UnknownKey(u32),
    #[error("invalid work request: {0}")]
    InvalidWr(String),
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    #[error("bad transport endpoint {0:?}")]
    BadEndpoint(String),
    #[error("the KV transport's peer failed authentication: {0}")]
    Auth(String),
    #[error("the system's random source failed")]
    Entropy,
    #[error("KV transport TLS: {0}")]
    Tls(String),
    #[error("not supported by the {transport} transport: {what}")]
    Unsupported {
        transport: &'static str,
        what: &'static str,
    },
}

/// Why the target refused to land bytes (reported to the initiator as `REM_ACCESS_ERR`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("remote access error: {0}")]
pub struct AccessError(pub String);

/// Memory the target lends to [`KvTransport::poll_recv`] so that arrived writes can land.
///
/// Two ways in, both after the transport checked that the key is valid and the write's range
/// lies within the region: [`TargetMemory::write`] copies staged bytes; the direct pair
/// [`TargetMemory::dest`] / [`TargetMemory::dest_done`] lets a transport read from its wire
/// straight into the destination (no staging copy — the software analogue of a NIC's DMA).
pub trait TargetMemory {
    /// Write `bytes` at `offset` of the region registered as `rkey`.
    fn write(&mut self, rkey: u32, offset: u64, bytes: &[u8]) -> Result<(), AccessError>;

    /// Whether [`TargetMemory::dest`] is supported.
    fn direct(&self) -> bool {
        false
    }

    /// Direct landing: the longest contiguous destination of at most `max_len` (> 0) bytes at
    /// `offset` of `rkey`'s region. The transport fills it completely before asking for the next.
    fn dest(&mut self, rkey: u32, offset: u64, max_len: usize) -> Result<&mut [u8], AccessError> {
        let _ = (rkey, offset, max_len);
        Err(AccessError(
            "this memory does not support direct landing".into(),
        ))
    }

    /// Direct landing, gathered: append to `out` the destinations (in order, at least one) of
    /// up to `max_len` (> 0) bytes at `offset`, for one vectored read. The default hands out
    /// the single [`TargetMemory::dest`].
    fn dests<'a>(
        &'a mut self,
        rkey: u32,
        offset: u64,
        max_len: usize,
        out: &mut Vec<&'a mut [u8]>,
    ) -> Result<(), AccessError> {
        out.push(self.dest(rkey, offset, max_len)?);
        Ok(())
    }

    /// Direct landing of the write of `len` bytes at `offset` of `rkey`'s region is complete
    /// (every byte went through [`TargetMemory::dest`]). An error fails the write.
    fn dest_done(&mut self, rkey: u32, offset: u64, len: u64) -> Result<(), AccessError> {
        let _ = (rkey, offset, len);
        Ok(())
    }
}

/// Counters of a transport's target side.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TargetStats {
    pub landed_writes: u64,
    pub landed_bytes: u64,
    /// Writes refused because their key was invalidated or unknown, out of range, or
    /// registered for another pairing than the connection's.
    pub rejected_writes: u64,
    /// Connections closed before any frame was read: they did not prove a live pairing's
    /// secret (or failed the TLS handshake when encryption is on), or too many were
    /// authenticating at once.
    pub refused_connections: u64,
}

/// Most destinations one [`TargetMemory::dests`] call hands out (one vectored read).
pub const MAX_LAND_DESTS: usize = 64;

/// Proof that no write under region key `rkey` can land any more: returned by
/// [`KvTransport::invalidate`] and by nothing else. Its constructor is visible only inside this
/// module tree (the transports), so the decode engine's `release_quarantined`, which takes one, cannot
/// be fed a key that was not invalidated — safety property 2 as a type. (The constructor is
/// `pub(crate)` in this crate, which holds every transport: nothing outside can build one.) Neither `Clone` nor
/// `Copy`: one invalidation, one proof.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "the proof is what lets quarantined pages go back to the free list"]
pub struct KeyInvalidated {
    rkey: u32,
}

impl KeyInvalidated {
    /// Only a transport, after its key can no longer be used by any write, issues this.
    pub(crate) const fn issued_by_transport(rkey: u32) -> Self {
        Self { rkey }
    }

    /// The key this proves dead.
    pub const fn rkey(&self) -> u32 {
        self.rkey
    }
}

/// Faults a transport can inject on purpose (tests only, named as such; compiled only with the
/// `fault-injection` feature). A transport that cannot inject one returns
/// [`TransportError::Unsupported`].
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultInjection {
    /// Target: flip one byte of the next payload that lands (corruption the wire did not catch).
    CorruptNextPayload,
    /// Target: hold back every arriving write of this key (a delayed packet).
    HoldKey(u32),
    /// Target: deliver every held write at the next poll (late, perhaps after invalidation).
    ReleaseHeld,
    /// Initiator: cut the connection abruptly.
    Disconnect,
}

/// One-sided-write KV transport. One node uses the initiator half, the other the target half.
pub trait KvTransport: Send + std::fmt::Debug {
    /// Target: admit one more initiator. The returned [`Pairing`] (a random id and secret) goes
    /// to that initiator over the authenticated control plane; a `tcp` connection is accepted
    /// only once it proved the secret of a live pairing, and only writes to regions registered
    /// for its own pairing land. `verbs`: the queue pair is connected to exactly one peer
    /// through the control plane, which is what admits it (see the module docs of `verbs`).
    fn pair(&mut self) -> Result<Pairing, TransportError>;

    /// Target: withdraw a pairing. Its connections are closed at the next poll, and keys
    /// registered for it refuse every write from then on.
    fn unpair(&mut self, pairing_id: u64);

    /// Target: register a region of `len` bytes, writable only by connections of pairing
    /// `pairing_id`. Its key (`rkey` and `base` together: 64 random bits) is never reused.
    fn register(&mut self, len: u64, pairing_id: u64) -> Result<Region, TransportError>;

    /// Target: after this returns `Ok`, no write with `rkey` lands; the value returned is the
    /// proof of it.
    fn invalidate(&mut self, rkey: u32) -> Result<KeyInvalidated, TransportError>;

    /// Initiator: post a chain of work requests (linked through `next`).
    ///
    /// # Safety
    /// Every `sg_list` entry must point to `length` readable bytes that stay valid and unchanged
    /// until the chain's signaled completion is polled (a NIC reads them asynchronously); every
    /// `next`/`sg_list` pointer must be valid for the call.
    unsafe fn post_write(&mut self, wr: &SendWr) -> Result<(), TransportError>;

    /// Initiator: up to `max` send completions (signaled writes acknowledged or failed).
    fn poll_send(&mut self, out: &mut Vec<Wc>, max: usize) -> Result<usize, TransportError>;

    /// Target: land up to `max` arrived writes into `mem`; receive completions (writes with
    /// immediate data that landed) are appended to `out`.
    fn poll_recv(
        &mut self,
        mem: &mut dyn TargetMemory,
        out: &mut Vec<Wc>,
        max: usize,
    ) -> Result<usize, TransportError>;

    /// Initiator: whether the connection to the target is up.
    fn connected(&self) -> bool;

    /// `"tcp"` or `"verbs"` (stated in the handshake: both nodes must use the same).
    fn kind(&self) -> &'static str;

    /// What the peer needs to connect to this transport, exchanged over the control plane: a
    /// `tcp` target's listening address (an initiator: empty), a `verbs` queue pair's endpoint.
    fn endpoint(&self) -> String;

    /// Connect to the peer whose [`KvTransport::endpoint`] is `peer`, under `pairing` (what the
    /// target's [`KvTransport::pair`] issued). A `tcp` initiator dials (again, after a lost
    /// connection) and proves the pairing's secret (challenge–response, both ways) before any
    /// frame; a `tcp` target has nothing to do; `verbs` resets its queue pair if it was
    /// connected and drives it to the peer. Outstanding writes of an earlier connection
    /// complete in error, never silently.
    fn connect_peer(&mut self, peer: &str, pairing: &Pairing) -> Result<(), TransportError>;

    /// Drop the connection to the peer (if any) so that [`KvTransport::endpoint`] can be
    /// exchanged afresh: `verbs` takes its queue pair back to `INIT` with a new PSN (both sides
    /// must exchange endpoints again); `tcp` has nothing to do (`connect_peer` redials).
    fn reset(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    /// Initiator: make `len` bytes at `addr` usable as the source of posted writes (`verbs`:
    /// a local memory registration; `tcp`: nothing to do). Returns the local key
    /// ([`abi::Sge::lkey`]; 0 may be used, resolved by address).
    ///
    /// # Safety
    /// `addr..addr + len` must be mapped, readable memory that stays allocated as long as the
    /// transport lives.
    unsafe fn register_source(
        &mut self,
        addr: *const u8,
        len: usize,
    ) -> Result<u32, TransportError> {
        let _ = (addr, len);
        Ok(0)
    }

    /// Target-side counters.
    fn target_stats(&self) -> TargetStats {
        TargetStats::default()
    }

    /// Inject a fault (tests only). Returns a count where the fault has one (held writes
    /// released), else 0.
    #[cfg(feature = "fault-injection")]
    fn fault_inject(&mut self, f: FaultInjection) -> Result<usize, TransportError> {
        let _ = f;
        Err(TransportError::Unsupported {
            transport: self.kind(),
            what: "fault injection",
        })
    }
}

/// Dropping a result on purpose, with the reason in the code: for the results whose failure
/// has nothing left to act on (an asker that went away before its answer, a best-effort
/// shutdown of a socket already lost). The crates of `runtime/` deny
/// `clippy::let_underscore_must_use`, so a result is either handled or dropped through this,
/// which says why and leaves a trace-level record.
pub trait Discard {
    /// Drop `self`, an outcome whose failure needs no action, for the reason `why`.
    fn discard(self, why: &'static str);
}

impl<T, E> Discard for Result<T, E> {
    fn discard(self, why: &'static str) {
        if self.is_err() {
            tracing::trace!(why, "failed result dropped");
        }
    }
}

/// A post's work-request chain, validated before anything is built, sent or posted (a post is
/// all or nothing) — the one validation every transport shares: at most `max_chain` requests,
/// each an RDMA write (with or without immediate data) with a well-formed scatter/gather list
/// of at most `max_sge` entries. Returns the requests in chain order.
///
/// # Safety
/// As [`KvTransport::post_write`]: every `next` and `sg_list` pointer of the chain valid for
/// the lifetime `'a`.
pub(crate) unsafe fn validated_chain<'a>(
    first: &'a SendWr,
    max_chain: usize,
    max_sge: usize,
) -> Result<Vec<&'a SendWr>, TransportError> {
    let mut chain: Vec<&'a SendWr> = Vec::new();
    let mut wr: *const SendWr = first;
    while !wr.is_null() {
        if chain.len() >= max_chain {
            return Err(TransportError::InvalidWr(format!(
                "chain longer than {max_chain} work requests"
            )));
        }
        // SAFETY: the caller guarantees the chain's pointers are valid for 'a.
        let w: &'a SendWr = unsafe { &*wr };
        if w.opcode != abi::WR_RDMA_WRITE && w.opcode != abi::WR_RDMA_WRITE_WITH_IMM {
            return Err(TransportError::InvalidWr(format!("opcode {}", w.opcode)));
        }
        if w.num_sge < 0 || (w.num_sge > 0 && w.sg_list.is_null()) {
            return Err(TransportError::InvalidWr("bad scatter/gather list".into()));
        }
        if w.num_sge as usize > max_sge {
            return Err(TransportError::InvalidWr(format!(
                "{} scatter/gather entries, at most {max_sge}",
                w.num_sge
            )));
        }
        chain.push(w);
        wr = w.next;
    }
    Ok(chain)
}

/// The scatter/gather entries of a request of a [`validated_chain`].
///
/// # Safety
/// `w` comes from [`validated_chain`], whose caller guaranteed its `sg_list` valid as long as `w`.
pub(crate) unsafe fn sges_of(w: &SendWr) -> &[abi::Sge] {
    if w.num_sge == 0 {
        return &[];
    }
    // SAFETY: `num_sge` (validated non-negative) entries at `sg_list` (validated non-null).
    unsafe { std::slice::from_raw_parts(w.sg_list, w.num_sge as usize) }
}

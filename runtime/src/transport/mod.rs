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

pub mod abi;
pub mod tcp;
#[cfg(feature = "rdma")]
pub mod verbs;

use abi::{SendWr, Wc};

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
}

/// Why the target refused to land bytes (reported to the initiator as `REM_ACCESS_ERR`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("remote access error: {0}")]
pub struct AccessError(pub String);

/// Memory the target lends to [`KvTransport::poll_recv`] so that arrived writes can land.
pub trait TargetMemory {
    /// Write `bytes` at `offset` of the region registered as `rkey`. The transport has already
    /// checked that the key is valid and `offset + len` is within the region.
    fn write(&mut self, rkey: u32, offset: u64, bytes: &[u8]) -> Result<(), AccessError>;
}

/// One-sided-write KV transport. One node uses the initiator half, the other the target half.
pub trait KvTransport: Send + std::fmt::Debug {
    /// Target: register a region of `len` bytes.
    fn register(&mut self, len: u64) -> Result<Region, TransportError>;

    /// Target: after this returns, no write with `rkey` lands.
    fn invalidate(&mut self, rkey: u32) -> Result<(), TransportError>;

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
}

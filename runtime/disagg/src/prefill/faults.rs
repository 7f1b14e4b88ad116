//! Fault injection into a running prefill node (feature `fault-injection`: tests only, never
//! compiled into a binary). Each fault is an engine bug or a crash on purpose, to prove that
//! the decode node, the witness or the protocol catches it.

use super::super::protocol::ReqEvent;
use super::super::transfer_id;
use super::{RequestId, abi, proto};
use crate::transport::Discard;
use crate::transport::abi::SendWr;
use crate::transport::{FaultInjection, KvTransport};

/// Fault injection into a running prefill node (tests only, named as such).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillFault {
    /// Cut the KV transport connection (as a crashed NIC or process would).
    DisconnectTransport,
    /// An engine bug the engine cannot see: with the next transfer, post one extra write (a copy
    /// of the first page's first work request, same place, overwritten by the real one right
    /// after) under a wr_id no transfer has, and record nothing about it. Only the eBPF
    /// witness sees it.
    PhantomWrite,
    /// An engine bug the engine cannot see: remember the next transfer's pages; with the
    /// transfer after it, re-send one of the earlier transfer's writes (its wr_id) into the new
    /// reservation, at a page the decode node reallocated from the earlier request to the new
    /// one when there is one (else the first page) — a stale write into a reallocated page. It
    /// lands before the new page's own write, which overwrites it, so decode's verification
    /// passes and the engine's record stays clean. Only the eBPF witness sees it.
    StaleWrite,
    /// A protocol bug: the next request to post applies this event to its machine first (for
    /// example `Handoff` while `Prefilling`). The machine refuses it, and the request must fail
    /// cleanly — the illegal transition named as the reason — never be ignored.
    ProtocolEvent(ReqEvent),
}

/// State of the witness-only stale write.
#[derive(Debug, Default)]
enum StaleFault {
    #[default]
    Off,
    /// Armed: the next transfer's (transfer id, decode page) pairs are remembered.
    Recording,
    /// Fire on the next transfer with these earlier writes.
    Ready(Vec<(u64, u32)>),
}

/// One unrecorded extra write: a copy of page `page_index`'s first work request under `wr_id`.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExtraWrite {
    pub(super) page_index: usize,
    wr_id: u64,
}

/// The faults armed on one prefill node.
#[derive(Debug, Default)]
pub(super) struct FaultState {
    phantom_next: bool,
    stale: StaleFault,
    event_next: Option<ReqEvent>,
}

impl FaultState {
    pub(super) fn arm(&mut self, f: PrefillFault, transport: &mut dyn KvTransport) {
        match f {
            PrefillFault::DisconnectTransport => {
                if let Err(e) = transport.fault_inject(FaultInjection::Disconnect) {
                    tracing::warn!(error = %e, "fault injection refused");
                }
            }
            PrefillFault::PhantomWrite => self.phantom_next = true,
            PrefillFault::StaleWrite => self.stale = StaleFault::Recording,
            PrefillFault::ProtocolEvent(ev) => self.event_next = Some(ev),
        }
    }

    pub(super) fn take_injected_event(&mut self) -> Option<ReqEvent> {
        self.event_next.take()
    }

    /// The extra write the next transfer (request `id`, `n_pages` pages into `dst`) carries.
    pub(super) fn extra_write(
        &mut self,
        id: RequestId,
        n_pages: usize,
        dst: &[proto::Page],
    ) -> Option<ExtraWrite> {
        if n_pages == 0 {
            return None;
        }
        let mut extra = None;
        if std::mem::take(&mut self.phantom_next) {
            extra = Some(ExtraWrite {
                page_index: 0,
                wr_id: transfer_id(id, 0xffff),
            });
        }
        // Only a ready stale fault fires (and is used up); a recording one waits for `after_post`.
        if matches!(self.stale, StaleFault::Ready(_))
            && let StaleFault::Ready(earlier) = std::mem::take(&mut self.stale)
        {
            let reused = (0..n_pages).find_map(|j| {
                earlier
                    .iter()
                    .find(|(_, p)| *p == dst[j].page)
                    .map(|&(t, _)| (j, t))
            });
            extra = reused
                .or(earlier.first().map(|&(t, _)| (0, t)))
                .map(|(page_index, wr_id)| ExtraWrite { page_index, wr_id });
        }
        extra
    }

    /// After a transfer was posted: a recording stale fault remembers its writes.
    pub(super) fn after_post(&mut self, id: RequestId, n_pages: usize, dst: &[proto::Page]) {
        if matches!(self.stale, StaleFault::Recording) {
            self.stale = StaleFault::Ready(
                (0..n_pages)
                    .map(|idx| (transfer_id(id, idx), dst[idx].page))
                    .collect(),
            );
        }
    }
}

/// Post an unrecorded copy of a page's first write (posted before the page's own chain).
pub(super) fn post_unrecorded_copy(
    transport: &mut dyn KvTransport,
    chain: &(Vec<abi::Sge>, Vec<SendWr>),
    extra: ExtraWrite,
    rkey: u32,
) {
    let (sges, wrs) = chain;
    let n = usize::try_from(wrs[0].num_sge).unwrap_or(0).min(sges.len());
    let copy = SendWr::rdma_write(extra.wr_id, &sges[..n], wrs[0].remote_addr, rkey);
    tracing::warn!(
        wr_id = extra.wr_id,
        page_index = extra.page_index,
        "FAULT INJECTION (test only): unrecorded KV write"
    );
    // SAFETY: as for the page's own chain: the SGEs are the page's, in registered memory,
    // alive for the call; unsignaled, so no completion refers to it.
    let posted = unsafe { transport.post_write(&copy) };
    posted.discard("the injected write is unsignaled: a refused post is the fault's own outcome");
}

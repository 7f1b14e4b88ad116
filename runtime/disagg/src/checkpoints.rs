//! The pair's peer checkpoint exchange: each node keeps the other's newest signed checkpoints in
//! its own log, a place the other node's disk cannot rewrite — so a cut tail of one node's log
//! (its newest digest and the files it names deleted) shows when the root is verified, from the
//! other node's sealed `node_events` (`docs/audit-schema.md`, *Checkpoint*).
//!
//! Prefill drives it: every interval it sends its own newest checkpoint over the control plane
//! (`Decode.ExchangeCheckpoints`); decode keeps it and answers with its own, which prefill keeps.
//! Checkpoints travel as opaque JSON (`custody_audit::CheckpointExchange`); what a node keeps is
//! not trusted: `custody audit verify` checks every checkpoint against its node's key.

use std::sync::Arc;
use std::time::Duration;

use custody_audit::CheckpointExchange;
use tonic::Status;
use tonic::transport::Channel;

use crate::proto::{self, decode_client::DecodeClient};

/// Most checkpoints one exchange carries (a node sends its own newest).
pub const EXCHANGE_MAX_CHECKPOINTS: usize = 4;
/// Most bytes of one checkpoint's JSON (one is about 500 B).
pub const CHECKPOINT_MAX_BYTES: usize = 4096;

/// What a node needs to take part: its side of the exchange, and how often prefill runs it.
#[derive(Clone, Debug)]
pub struct PeerCheckpoints {
    /// This node's newest checkpoint, and where the peer's are kept (its own log).
    pub book: Arc<dyn CheckpointExchange>,
    /// How often prefill exchanges (its writer's checkpoint interval).
    pub interval: Duration,
}

/// This node's newest checkpoint, to send.
pub(crate) fn own_message(book: &dyn CheckpointExchange) -> proto::Checkpoints {
    proto::Checkpoints {
        checkpoints: book.own().into_iter().collect(),
    }
}

/// Keep what the peer sent (bounded); returns how many were new. Blocking (see
/// [`CheckpointExchange::keep`]).
pub(crate) fn keep(
    book: &dyn CheckpointExchange,
    sent: &proto::Checkpoints,
) -> Result<usize, Status> {
    if sent.checkpoints.len() > EXCHANGE_MAX_CHECKPOINTS {
        return Err(Status::invalid_argument(format!(
            "{} checkpoints in one exchange (at most {EXCHANGE_MAX_CHECKPOINTS})",
            sent.checkpoints.len()
        )));
    }
    let mut kept = 0;
    for text in &sent.checkpoints {
        if text.len() > CHECKPOINT_MAX_BYTES {
            return Err(Status::invalid_argument(format!(
                "a checkpoint of {} bytes (at most {CHECKPOINT_MAX_BYTES})",
                text.len()
            )));
        }
        let new = book.keep(text).map_err(|e| match e {
            custody_audit::ExchangeRefused::Log(_) => Status::unavailable(e.to_string()),
            _ => Status::invalid_argument(e.to_string()),
        })?;
        kept += usize::from(new);
    }
    Ok(kept)
}

/// Prefill's side: exchange every `interval` until the node is gone (`alive` dropped). A failed
/// exchange is logged and retried at the next interval (the checkpoints' absence is what a
/// verifier sees).
pub(crate) async fn exchange_loop(
    mut decode: DecodeClient<Channel>,
    book: Arc<dyn CheckpointExchange>,
    interval: Duration,
    alive: std::sync::Weak<()>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if alive.upgrade().is_none() {
            return;
        }
        let reply = match decode.exchange_checkpoints(own_message(&*book)).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                tracing::warn!(error = %s.message(), "checkpoint exchange with decode failed");
                continue;
            }
        };
        let book = book.clone();
        match tokio::task::spawn_blocking(move || keep(&*book, &reply)).await {
            Ok(Ok(n)) => tracing::debug!(kept = n, "decode's checkpoints kept"),
            Ok(Err(s)) => tracing::warn!(error = %s.message(), "decode's checkpoints not kept"),
            Err(e) => tracing::warn!(error = %e, "decode's checkpoints not kept"),
        }
    }
}
